"""The machine's GPUs as NVML sees them, and how processes share them. Never imports torch.

``inventory`` reads NVML (``fake_nvml`` stands in for it in tests and demos); ``visible`` maps
``CUDA_VISIBLE_DEVICES`` to NVML GPUs; ``select`` judges GPUs against criteria; ``claims`` holds
GPUs with file locks; ``waiting`` queues fairly for GPUs that are busy.

The public names live on :mod:`gpukit` (``gk.inventory()``, ``gk.pick()``, ``gk.claim()``).
"""
