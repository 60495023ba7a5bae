"""`appliance pipeline` (every stage from one config) and `appliance demo` (the same on bundled data)."""
