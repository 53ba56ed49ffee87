"""Proxy: routes each request to a prefill server, then to a decode server."""
