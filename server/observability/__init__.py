"""Prometheus metrics read from the live domain objects."""
