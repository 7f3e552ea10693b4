"""The model seam's old name: it lives on the base floor now (``engine.base.seam``)."""

from engine.base.seam import *  # noqa: F401,F403
