"""The machine's GPUs as NVML sees them, and how processes share them. Never imports torch.

``inventory`` reads NVML (``fake_nvml`` stands in for it in tests and demos); ``visible`` maps
``CUDA_VISIBLE_DEVICES`` to NVML GPUs; ``select`` judges GPUs against criteria; ``claims`` holds
GPUs with file locks; ``waiting`` queues fairly for GPUs that are busy; ``ledger`` records each
claim's start and end, ``usage`` adds them up per user, and ``sharing`` is what ``gpukit queue``
shows.

The public names live on :mod:`gpukit` (``gk.inventory()``, ``gk.pick()``, ``gk.claim()``).
"""
