"""Model definitions (one file per family), the registry and the checkpoint loader."""
