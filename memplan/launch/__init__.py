"""Launch configurations for a plan: Megatron-LM's arguments now (megatron); other frameworks later."""
