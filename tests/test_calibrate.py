"""The linear calibration (engine/native/calibrate.py): a decode linear takes the native kernel only
where it measured faster than torch for its weight form and row class; the measurement is stored
beside the library and read back; SkinnyLinear follows it."""
from __future__ import annotations

import json

import pytest
import torch

from engine import native
from engine.model.held_weights import pack_weight
from engine.model.linears import SkinnyLinear
from engine.native import calibrate

needs_native = pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")


@pytest.fixture(autouse=True)
def fresh():
    calibrate._reset_for_tests()
    yield
    calibrate._reset_for_tests()


def fake_report(torch_wins: set[str]) -> dict:
    keys = [f"{name}/{calibrate.row_class(lo)}" for name in calibrate.FORMS.values() for lo, _ in calibrate.ROW_CLASSES]
    return {"version": calibrate.VERSION, "torch": torch.__version__, "isa": "test",
            "ms": {}, "native": {k: k not in torch_wins for k in keys}}


def test_row_classes_cover_every_row_count_once():
    assert [calibrate.row_class(r) for r in (1, 2, 4, 5, 8, 9, 64)] == ["1", "2-4", "2-4", "5-8", "5-8", "9-64", "9-64"]
    with pytest.raises(ValueError):
        calibrate.row_class(65)


def test_table_takes_torch_for_the_classes_where_torch_won():
    table = calibrate.table_of(fake_report({"fp32/2-4", "affine4/9-64"}))
    assert table[0][1] and not any(table[0][2:5]) and all(table[0][5:65])
    assert all(table[4][1:9]) and not any(table[4][9:65])
    assert all(table[8][1:65])


@needs_native
def test_the_measurement_is_stored_beside_the_library_and_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv(calibrate.ENV, "1")
    path = tmp_path / "lib.calib.json"
    monkeypatch.setattr(calibrate, "report_path", lambda: path)
    calls = []
    monkeypatch.setattr(calibrate, "measure", lambda: calls.append(1) or fake_report({"scaled8/1"}))
    assert not calibrate.use_native(8, 1) and calibrate.use_native(8, 2)
    assert json.loads(path.read_text())["native"]["scaled8/1"] is False
    calibrate._reset_for_tests()
    assert not calibrate.use_native(8, 1) and calls == [1]  # read back, not measured again
    path.write_text(json.dumps(dict(fake_report(set()), torch="0.0")))  # another torch: measured anew
    calibrate._reset_for_tests()
    assert not calibrate.use_native(8, 1) and calls == [1, 1]
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


@needs_native
def test_the_real_measurement_times_every_class_both_ways():
    rep = calibrate.measure(repeats=1, shape=(256, 512))
    keys = {f"{n}/{calibrate.row_class(lo)}" for n in calibrate.FORMS.values() for lo, _ in calibrate.ROW_CLASSES}
    assert set(rep["ms"]) == keys == set(rep["native"])
    assert all(t["native"] > 0 and t["torch"] > 0 for t in rep["ms"].values())
    assert rep["native"] == {k: t["native"] < t["torch"] for k, t in rep["ms"].items()}
    assert rep["isa"] == native.isa()


@needs_native
@pytest.mark.parametrize("packed", [False, True])
def test_skinny_linear_follows_the_calibration(monkeypatch, packed):
    from tests.test_linears import affine4_weight

    lin = torch.nn.Linear(128, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(affine4_weight(64, 128))
    ref = torch.nn.Linear(128, 64)
    ref.load_state_dict(lin.state_dict())
    lin.__class__ = SkinnyLinear
    lin.packed = pack_weight(lin.weight.detach()) if packed else None
    assert (lin.packed is not None) == packed
    form = 4 if packed else 0
    calls = []
    real = SkinnyLinear.native
    monkeypatch.setattr(SkinnyLinear, "native", lambda self, flat: calls.append(flat.shape[0]) or real(self, flat))
    name = calibrate.FORMS[form]
    monkeypatch.setattr(calibrate, "_table", calibrate.table_of(fake_report({f"{name}/1", f"{name}/9-64"})))
    x1, x3, x20 = torch.randn(1, 128), torch.randn(3, 128), torch.randn(20, 128)
    with torch.no_grad():
        for x in (x1, x3, x20):
            torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    assert calls == [3]  # 1 row and 20 rows went to torch, 3 rows to the native kernel


def test_no_library_means_torch_everywhere(monkeypatch):
    monkeypatch.setattr(native, "lib", lambda: None)
    assert not any(calibrate.use_native(form, r) for form in calibrate.FORMS for r in (1, 8, 64))
    assert set(calibrate.paths().values()) == {"torch"}
