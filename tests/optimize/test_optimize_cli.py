"""`kvmesh optimize prune | distill` as a user calls it: results on success, one clear
error line (exit 2, no traceback) on bad input."""

import json
import subprocess
import sys

import pytest

from kvmesh.cli import main


def _run(capsys, *args):
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory(num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_prune_then_distill_from_the_cli(model, tmp_path, capsys):
    rc, out, err = _run(capsys, "optimize", "prune", str(model), str(tmp_path / "p"), "--drop-layers", "1",
                        "--heads", "2", "--mlp-ratio", "0.5", "--calibration-windows", "2",
                        "--calibration-seq-len", "32", "--threads", "1")
    assert rc == 0, err
    assert "fewer" in out and "3 layers, 2 heads, MLP width 64" in out
    rc, out, err = _run(capsys, "optimize", "distill", str(model), str(tmp_path / "p"), str(tmp_path / "d"),
                        "--steps", "2", "--batch-size", "1", "--seq-len", "16", "--threads", "1")
    assert rc == 0, err
    assert "distilled 2 steps" in out and "distill" in err  # tqdm bar on stderr
    meta = json.loads((tmp_path / "d" / "kvmesh_optimize.json").read_text())
    assert meta["kind"] == "distill" and len(meta["teacher_layers"]) == 3
    rc, out, err = _run(capsys, "optimize", "distill", str(model), str(tmp_path / "f"), "--student",
                        "first-layers:2", "--steps", "1", "--batch-size", "1", "--seq-len", "16", "--threads", "1")
    assert rc == 0, err
    assert json.loads((tmp_path / "f" / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize("args, message", [
    (["prune", "MODEL", "OUT", "--heads", "3"], "--heads: 3 query heads cannot be kept"),
    (["prune", "MODEL", "OUT"], "nothing to prune"),
    (["prune", "MODEL", "OUT", "--target-params", "lots"], "--target-params: cannot read 'lots'"),
    (["prune", "MODEL", "OUT", "--target-params", "50%", "--mlp-ratio", "0.5"], "--target-params chooses"),
    (["prune", "NOWHERE", "OUT", "--drop-layers", "1"], "is not a folder"),
    (["distill", "MODEL", "OUT", "--steps", "1"], "give TEACHER STUDENT OUT"),
    (["distill", "MODEL", "A", "B", "--student", "first-layers:1", "--steps", "1"], "with --student give only"),
    (["distill", "MODEL", "first-layers:1", "OUT", "--steps", "1", "--temperature", "-1"], "--temperature"),
    (["distill", "MODEL", "first-layers:1", "OUT", "--steps", "1", "--resume"], "--resume: no checkpoint"),
])
def test_bad_input_is_one_clear_error(model, tmp_path, capsys, args, message):
    args = [str(model) if a == "MODEL" else str(tmp_path / a) if a in ("OUT", "A", "B", "NOWHERE") else a
            for a in args]
    rc, _, err = _run(capsys, "optimize", *args)
    assert rc == 2
    assert message in err and "Traceback" not in err


def test_missing_steps_is_an_argparse_error_in_a_real_process(model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "optimize", "distill", str(model), "first-layers:1",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--steps" in r.stderr and "Traceback" not in r.stderr
