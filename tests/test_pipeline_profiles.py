"""The profiles packaged with dearcomm.pipeline, and a user's own file named
by argument or by DEARCOMM_PROFILES. One process."""
import json

import pytest

from dearcomm.pipeline import layer_records, load_shared_profile, param_tensors, shared_profile_names

# Published parameter counts (Hugging Face, torchvision): nothing lost or doubled in the packaged sizes.
PUBLISHED = {"bert-large": 335_141_888, "gpt2-small": 124_439_808, "vgg16": 138_357_544, "resnet50": 25_557_032}


def test_packaged_profiles_load_by_name():
    assert {"pipedream/vgg16", "pipedream/resnet50", "pipedream/gnmt", "dapple/bert-24-pbs-6"} <= \
        set(shared_profile_names())
    bert = load_shared_profile("dapple/bert-24-pbs-6")
    records = layer_records("dapple/bert-24-pbs-6")
    assert len(bert) == len(records) == 29
    assert [l.forward_ms for l in bert.layers] == [r["fwd_ms"] for r in records]
    assert bert.total_ms() == pytest.approx(sum(r["fwd_ms"] + r["bwd_ms"] for r in records))
    for model, count in PUBLISHED.items():
        assert sum(n for _, n in param_tensors(model)) == count, model


def test_a_users_file_by_argument_or_environment(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({
        "columns": ["id", "op", "forward_ms", "backward_ms", "activation_bytes", "param_bytes"],
        "models": {"tiny": {"layers": [["a", "Linear", 1.0, 2.0, 10.0, 4.0], ["b", "Linear", 3.0, 4.0, 20.0, 8.0],
                                       ["c", "Add", 0.5, 0.5, 30.0, 0.0]],
                            "edges": [[0, 1], [1, 2], [0, 2]]}}}))
    tiny = load_shared_profile("tiny", str(path))
    assert tiny.cut_bytes == (10.0, 10.0 + 20.0)  # the skip a -> c crosses the second cut too
    monkeypatch.setenv("DEARCOMM_PROFILES", str(path))
    assert shared_profile_names() == ["tiny"] and load_shared_profile("tiny") == tiny
    with pytest.raises(ValueError, match=r"dearcomm: no profile 'vgg' in .*mine.json; expected one of \['tiny'\]"):
        load_shared_profile("vgg")
    monkeypatch.setenv("DEARCOMM_PROFILES", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match=r"dearcomm: no profile file .*missing.json.*DEARCOMM_PROFILES"):
        load_shared_profile("tiny")


def test_a_malformed_file_is_refused_by_name(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"columns": ["id", "forward_ms"], "models": {"m": {"layers": [["a", 1.0]]}}}))
    with pytest.raises(ValueError, match=r"dearcomm: .*bad.json: columns must be"):
        load_shared_profile("m", str(path))
    path.write_text(json.dumps({"columns": ["id", "op", "forward_ms", "backward_ms", "activation_bytes",
                                            "param_bytes"], "models": {"m": {"layers": [["a", "x", 1.0, 1.0, 0.0, 0.0]],
                                                                             "edges": [[0, 5]]}}}))
    with pytest.raises(ValueError, match=r"edge \[0, 5\] must be two layer indices of this profile"):
        load_shared_profile("m", str(path))
    data = json.loads(path.read_text())
    data["models"]["m"]["layers"].append(["b", "x", 1.0, 1.0, 0.0, 0.0])
    data["models"]["m"]["edges"] = [[0, 1.0]]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"edge \[0, 1.0\] must be two layer indices of this profile \(ints\)"):
        load_shared_profile("m", str(path))
    with pytest.raises(ValueError, match="no model 'bert' in the packaged param_tensors.json"):
        param_tensors("bert")


def _objects(*ids, edges=None) -> dict:
    model = {"layers": [{"id": i, "fwd_ms": 1.0, "bwd_ms": 1.0, "act_bytes": 8.0, "param_bytes": 4.0}
                        for i in ids]}
    if edges is not None:
        model["edges"] = edges
    return {"m": model}


@pytest.mark.parametrize("data, message", [
    ({"m": {"layers": [["a", 1, 1, 1, 1]]}}, r"layer 0 must be an object with the keys id, fwd_ms"),
    ({"m": {"layers": [5]}}, r"layer 0 must be an object"),
    (_objects("a", "b", edges=[["a"]]), r"edge \['a'\] must be two layer ids of this profile"),
    (_objects("a", "b", edges=[["a", "x"]]), r"edge \['a', 'x'\] must be two layer ids"),
    (_objects("a", "b", edges=5), r"edges must be a list of \[source, destination\] pairs"),
    (_objects("a", "b", edges=[["b", "a"]]), r"edge \['b', 'a'\] runs from a layer to an earlier one"),
    (_objects("a", "a", "b", edges=[["a", "b"]]), r"layer id 'a' appears twice \(layer 1\)"),
])
def test_a_structurally_wrong_file_is_refused_by_name(tmp_path, data, message):
    """Each of these raised a bare AttributeError, TypeError or unpacking
    error, or (unknown, backward or repeated ids) dropped edges silently."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"dearcomm: profile 'm' in .*mine.json: " + message):
        load_shared_profile("m", str(path))


def test_repeated_ids_in_rows_are_refused_by_name(tmp_path):
    """Rows name their edges by index, but the profile joins layers by id:
    a repeated id gave one layer's edges to another, and wrong cut sizes."""
    columns = ["id", "op", "forward_ms", "backward_ms", "activation_bytes", "param_bytes"]
    rows = [["x", "L", 1, 2, 10, 1], ["x", "L", 1, 2, 100, 1], ["y", "L", 1, 2, 1000, 1], ["z", "L", 1, 2, 1e4, 1]]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"columns": columns, "models": {"m": {"layers": rows,
                                                                     "edges": [[0, 1], [1, 2], [2, 3], [0, 3]]}}}))
    with pytest.raises(ValueError, match=r"dearcomm: profile 'm' in .*mine.json: layer id 'x' appears twice "
                                         r"\(layer 1\); ids must be unique"):
        load_shared_profile("m", str(path))


def test_a_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('{"m": ')
    with pytest.raises(ValueError, match=r"dearcomm: profile file .*cut.json' is not valid JSON"):
        load_shared_profile("m", str(path))
