"""The standalone host: ``odyssey train`` and ``odyssey demo`` run our own megatron-core stages through
the shared recovery machinery of :mod:`megatron_odyssey.runtime`."""
