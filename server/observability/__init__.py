"""Prometheus metrics read from the live domain objects."""

__all__: list[str] = []
