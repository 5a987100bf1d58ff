"""`tandem audit`'s runs and statistics."""
