"""Measuring tools: bench, loadtest, profile, overhead, demo, faults. They use the public API
and the service; nothing in the product imports them."""
