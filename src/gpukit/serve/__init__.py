"""``gpukit serve``: the machine's GPUs as Prometheus metrics, JSON and a live dashboard page.

``sampler`` reads the machine in the background and renders every answer; ``metrics`` turns a
sample into the Prometheus text format, with ``dcgm`` adding the readings under dcgm-exporter's
names; ``server`` answers HTTP requests from the last sample; ``static/`` holds the page, its
script and its style (no CDN: they ship in the package).
Needs the ``serve`` extra (``pip install 'gpukit[serve]'``, for prometheus_client).
"""

from gpukit.serve.sampler import History, Sample, Sampler
from gpukit.serve.server import DashboardServer, is_loopback

__all__ = ["DashboardServer", "History", "Sample", "Sampler", "is_loopback"]
