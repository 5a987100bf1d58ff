"""The soak: the service under a long, mixed and faulty load, then a check that it lost nothing."""
