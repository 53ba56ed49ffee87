"""The PD protocol: the kv_transfer_params types, their signing, the compatibility hash,
the connectors' configuration and the connectors by name."""
