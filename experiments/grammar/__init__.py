"""Grammar engines measured side by side (compile time, mask time, rollback)."""
