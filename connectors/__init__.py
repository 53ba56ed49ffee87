"""KV connectors: move prefilled KV blocks between prefill and decode workers."""
