"""A stand-in for NVML (``pynvml``) for ``--log-energy`` on machines without a GPU: put this folder first on
PYTHONPATH. Every device draws 1 MJ per training iteration (its counter reads the iteration Megatron-LM has reached),
so Megatron's energy figures are exact and can be computed by hand: stock prints 1000000.0 J/iter/GPU."""


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetHandleByIndex(index):  # noqa: ANN001, ANN201 (NVML's own signature)
    return index


def nvmlDeviceGetTotalEnergyConsumption(handle) -> int:  # noqa: ANN001
    """In mJ, as NVML."""
    from megatron.training import get_args

    return int(getattr(get_args(), "curr_iteration", 0)) * 10**9
