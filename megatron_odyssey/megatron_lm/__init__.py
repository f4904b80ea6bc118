"""The Megatron-LM host: a ``pretrain_gpt.py`` rank under ``--odyssey`` (what the adaptor's patches call,
the rank's protocol, the forward-backward dispatcher, and the CPU mode the tests run Megatron-LM in)."""
