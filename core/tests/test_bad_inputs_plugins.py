"""Bad plugin selection through the real CLI entry (``unirl.cli.main``): ``UNIRL_PLUGINS``.

Why these are errors and not warnings: an allowlist entry that matches no installed entry point drops
the plugin the user meant, and the run used to train without it after a raw ``UserWarning``. Now it
exits 2 with one line naming the variable, the unknown name, what is installed and the fix, before
any model is built.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from unirl import cli
from unirl.kernel.errors import PluginError
from unirl.kernel.manager import load_kernel

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "arith-tiny.yaml")


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """One installed plugin: distribution ``acme-alpha``, entry point ``acme_alpha``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "acme_alpha.py").write_text(textwrap.dedent("""
        from unirl.kernel import hookimpl
        @hookimpl
        def unirl_rewards():
            return {"acme": "acme_alpha:reward"}
        def reward(**kw):
            return 0.0
    """))
    info = site / "acme_alpha-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-alpha\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[unirl.plugins]\nacme_alpha = acme_alpha\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop("acme_alpha", None)




def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    return err


def test_train_with_an_allowlist_of_no_installed_plugin_exits_2_and_builds_nothing(acme, no_model, monkeypatch,
                                                                                    capsys, tmp_path):
    monkeypatch.setenv("UNIRL_PLUGINS", "nosuchplugin")
    assert cli.main(["train", RECIPE, f"run.output_dir={tmp_path / 'runs'}"]) == 2
    err = _one_error_line(capsys)
    assert "UNIRL_PLUGINS=nosuchplugin" in err and "'nosuchplugin' is not the entry point" in err
    assert "installed entry points: " in err and "acme_alpha" in err
    assert "fix: " in err and "unset UNIRL_PLUGINS" in err
    assert not (tmp_path / "runs").exists()  # nothing written either


def test_a_typo_next_to_a_known_name_is_an_error_with_the_corrected_list(acme, no_model, monkeypatch, capsys):
    """``core,acme_alpah``: core would load and acme-alpha would silently not."""
    monkeypatch.setenv("UNIRL_PLUGINS", "core,acme_alpah")
    assert cli.main(["train", RECIPE]) == 2
    err = _one_error_line(capsys)
    assert "'acme_alpah' (did you mean 'acme_alpha'?)" in err
    assert "fix: set UNIRL_PLUGINS=core,acme_alpha" in err


def test_a_distribution_name_is_mapped_to_its_entry_point(acme, monkeypatch):
    monkeypatch.setenv("UNIRL_PLUGINS", "acme-alpha")
    with pytest.raises(PluginError, match=r"'acme-alpha' \(did you mean 'acme_alpha'\?\)"):
        load_kernel()


def test_unirl_plugins_prints_the_same_error(acme, monkeypatch, capsys):
    monkeypatch.setenv("UNIRL_PLUGINS", "nosuchplugin")
    assert cli.main(["plugins"]) == 2
    assert "UNIRL_PLUGINS=nosuchplugin" in _one_error_line(capsys)


def test_a_good_allowlist_still_loads_and_lists(acme, monkeypatch, capsys):
    monkeypatch.setenv("UNIRL_PLUGINS", " acme_alpha ")
    kernel = load_kernel()
    status = {p.entry_point: p.status for p in kernel.plugins}
    assert status["acme_alpha"] == "loaded" and status["core"] == "loaded"
    assert all(s == "disabled" for n, s in status.items() if n not in ("acme_alpha", "core"))
    assert cli.main(["plugins", "--json"]) == 0


def test_a_plugin_command_with_a_bad_allowlist_is_one_line_not_a_traceback(monkeypatch, capsys):
    """``unirl trace replay`` (a plugin-registered command) looks the command up in the kernel first:
    a bad allowlist found there is the same one-line error."""
    monkeypatch.setenv("UNIRL_PLUGINS", "nosuchplugin")
    code = cli.main(["trace", "replay", "nowhere"])
    err = capsys.readouterr().err
    assert code == 2 and "UNIRL_PLUGINS=nosuchplugin" in err and "fix:" in err and "Traceback" not in err, err
