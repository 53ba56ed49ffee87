"""Worker side: model runner, block tables, canonical KV cache allocation."""
