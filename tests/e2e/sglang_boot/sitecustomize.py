"""Puts the SGLang CPU shims (tests/e2e/sglang_shims.py) into every process the SGLang
end-to-end test starts, spawned ones included; a no-op unless FLATCAKE_E2E_SGLANG_SHIMS=1
(this folder is on PYTHONPATH only for that test's engine)."""

import os

if os.environ.get("FLATCAKE_E2E_SGLANG_SHIMS") == "1":
    from tests.e2e import sglang_shims

    sglang_shims.install()
