"""How the machine's GPUs are shared between processes and users. Never imports torch.

``lockfiles`` opens the lock folder (``lock_folder`` says where it is; ``lock_setup`` makes an
administrator's) and ``flocks`` reads the kernel's lock table; ``claims`` holds GPUs with one lock
file each; ``waiters`` reads the queue of waiters and ``tickets`` joins it; ``policy`` is the
administrator's per-user limit; ``pick`` and ``acquire`` choose, wait and claim; ``ledger``
records each claim's start and end, ``usage`` adds them up per user, and ``report`` is what
``gpukit queue`` shows.

The public names live on :mod:`gpukit` (``gk.pick()``, ``gk.claim()``, ``gk.acquire()``).
"""
