"""What the fleet router and the worker's gateway share on the request path: tenants' API
keys, the one admission of a request (fields, caps, ownership, limits, the version), the
signed forwarded tenant and version, and the upstream HTTP client."""
