"""``pip install unirl-parity-vllm`` is light; a recipe that needs one of its extras (``[vllm]``,
``[fsdp]``) learns which, in one preflight line, before any model is built. The fresh-venv test
(``test_fresh_venv.py``) checks the same on a real light install; this one simulates it in seconds.
"""

from __future__ import annotations

from unirl.cli import main
from unirl_parity_vllm import profile


def test_missing_extra_is_one_preflight_line(monkeypatch, capsys):
    """The light install, simulated: unirl-vllm and unirl-fsdp not installed (metadata) and not loaded."""
    real = profile._version
    monkeypatch.setattr(profile, "_version", lambda n: None if n in ("unirl-vllm", "unirl-fsdp") else real(n))
    monkeypatch.setenv("UNIRL_PLUGINS", "parity")
    for flag in ("1", "0"):
        monkeypatch.setenv("UNIRL_PARITY_ENABLE", flag)
        assert main(["preflight", "parity-tiny"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            "error: preflight: [unirl-parity-vllm] rollout.engine, weight_sync.name, actor.name: the recipe uses "
            "engine 'vllm' and actor 'fsdp', which unirl-parity-vllm does not install by default (fix: pip install "
            "'unirl-parity-vllm[vllm,fsdp]')"]
    # a recipe that does not opt in to parity keeps core's own words
    monkeypatch.setenv("UNIRL_PARITY_ENABLE", "0")
    assert main(["preflight", "arith-tiny-vllm"]) == 2
    assert "no rollout engine named 'vllm'" in capsys.readouterr().err
