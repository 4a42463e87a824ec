"""The pretrained models beyond the first two pipelines, which only `make test-zoo` builds."""

from __future__ import annotations

# Not CI: tens of minutes on 2 cores; CI covers both architectures with tiny randomly initialised weights
# (tests/scenarios/test_add_contract.py).
ZOO = ["all_mpnet_base_v2", "efficientnet_lite1"]
