"""Crafted model files (issue 41): Keras archives, full-model HDF5 configurations and state_dicts, each built at
test time by tests/hostile_models.py (small on disk: zeros deflated, zip directories as holes of sparse files).

Every case is met by the real command in a process of its own (`seq`, `inspect --json`; tests/test_bombs.py's
launcher measures its peak memory): refused in one line `Error: ...` (exit 1), or computed right, under 150 MB,
within the launcher's hang limit, writing no file larger than ``FILE_LIMIT`` (a copy of a member to a temporary
file would fail: "File too large"), nothing left in its TMPDIR, the input untouched, `inspect --json` one JSON
document.  Keras configurations are held to what Keras 3 itself does with them (fixtures/keras/
config_verdicts.json, recorded by fixtures/make_keras_config_verdicts.py).  Fuzzed: configurations (.keras and
legacy .h5), archives and state_dict names."""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import hostile_models as hm
import numpy as np
import pytest
from conftest import FIXTURES, assert_close_scaled
from hypothesis import given
from hypothesis import strategies as st
from test_bombs import PEAK_MB, build_cases, fingerprint, run_measured
from test_fuzz import fuzz, traced_peak, watchdog

from lstmgrad_cli import frameworks, io
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import LstmGradError
from lstmgrad_cli.io import keras_archive
from lstmgrad_cli.operations.inspect import inspect_file
from lstmgrad_cli.problem.reading import load_problem

sys.path.insert(0, str(FIXTURES))

from keras_config_edits import EDITS, SOURCES, edited_archive_bytes  # noqa: E402

KERAS = FIXTURES / "keras"
RELU, RELU_IN = KERAS / "keras_relu.keras", KERAS / "keras_relu.in.npz"
RELU_EXPECTED = KERAS / "keras_relu.expected.npz"
BIDIR, BIDIR_IN = KERAS / "keras_bidir_concat.keras", KERAS / "keras_bidir_concat.in.npz"
LEGACY, LEGACY_IN = KERAS / "keras_legacy_h5.h5", KERAS / "keras_legacy_h5.in.npz"
LEGACY_GROUP = "model_weights/lstm/sequential/lstm"
TWO = KERAS / "keras_two_layers.weights.h5"
FILE_LIMIT = 1 << 20  # bytes any file a command writes may reach: its output here is kilobytes
MiB = 1 << 20


def with_weights(weights: Path, group: str | None, source: Path = RELU_IN) -> tuple[Path, tuple]:
    return source, ("--weights", str(weights), *(("--weights-group", group) if group else ()))


def expected(path: Path):
    """A check that the output holds the gradients of ``path`` (a fixture's .expected.npz)."""
    def check(out: Path):
        with np.load(out) as got, np.load(path) as want:
            for name in want.files:
                assert_close_scaled(got[name], want[name], name=name)
    return check


def zero_gradients(out: Path):
    with np.load(out) as got:
        assert got["x_grad"].shape == (1_000_000, 0, 3) and got["w_grad"].shape == (5, 8)
        assert not got["w_grad"].any() and not got["b_grad"].any() and not got["wci_grad"].any()


# name -> (builder(folder) -> (input, arguments), what `seq` must do: a fragment of its one-line refusal, or a check
# of the gradients it wrote).  Each is a row of issue 41's tables.
CASES = {
    "safetensors: a name twice under the group": (
        lambda d: (hm.torch_inputs(d / "in.npz"), ("--weights", str(hm.state_dict_twice_under_group(
            d / "w.safetensors")), "--weights-group", "rnn")),
        "both rnn.weight_ih_l0 and rnn/weight_ih_l0 are weight_ih_l0 under group 'rnn'"),
    "Keras 3 LSTM with time_major": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", RELU, hm.lstm_option("time_major", True)),
                               "layers/lstm"),
        "LSTM layer 'lstm' has time_major=true, an option Keras 3's LSTM does not take"),
    "Bidirectional of the string GRU": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", BIDIR, hm.lstm_option("layer", "GRU",
                                                                                      "Bidirectional")),
                               "layers/bidirectional", BIDIR_IN),
        "has a layer that is the string \"GRU\", not a serialised layer"),
    "LSTM config a list": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", RELU, hm.layer_config([1, 2])), "layers/lstm"),
        "an unnamed LSTM layer has a config that is the list [1, 2], not a JSON object"),
    "LSTM config a string": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", RELU, hm.layer_config("lstm")), "layers/lstm"),
        "has a config that is the string \"lstm\""),
    "dropout a string": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", RELU, hm.lstm_option("dropout", "abc")),
                               "layers/lstm"),
        "LSTM layer 'lstm' has dropout=\"abc\", not a rate"),
    "dropout a list": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", RELU, hm.lstm_option("dropout", [0.5])),
                               "layers/lstm"),
        "has dropout=[0.5], not a rate"),
    "recurrent_dropout an object": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", RELU, hm.lstm_option(
            "recurrent_dropout", {"rate": 0.5})), "layers/lstm"),
        "has recurrent_dropout={\"rate\": 0.5}, not a rate"),
    "Bidirectional config a list": (
        lambda d: with_weights(hm.edited_archive(d / "m.keras", BIDIR, hm.layer_config([], "Bidirectional")),
                               "layers/bidirectional", BIDIR_IN),
        "an unnamed Bidirectional layer has a config that is the list []"),
    "legacy model_config: dropout a string": (
        lambda d: with_weights(hm.legacy_with_config(d / "m.h5", LEGACY, hm.lstm_option("dropout", "abc")),
                               LEGACY_GROUP, LEGACY_IN),
        "LSTM layer 'lstm' has dropout=\"abc\", not a rate"),
    "config.json of a million empty lists (4 MiB)": (
        lambda d: with_weights(hm.archive_with_padded(d / "m.keras", RELU, "config.json", 4 * MiB), "layers/lstm"),
        "its config.json holds 1048"),
    "config.json of 63 MiB of empty lists": (
        lambda d: with_weights(hm.archive_with_padded(d / "m.keras", RELU, "config.json", 63 * MiB), "layers/lstm"),
        "its config.json declares 63.0 MiB, more than a model configuration can be"),
    "metadata.json of a million empty lists": (
        lambda d: with_weights(hm.archive_with_padded(d / "m.keras", RELU, "metadata.json", 4 * MiB),
                               "layers/lstm"),
        "its metadata.json holds 1048"),
    "legacy model_config of a million empty lists": (
        lambda d: with_weights(hm.legacy_with_config(d / "m.h5", LEGACY, text=hm.padded_json(
            json.loads(h5py.File(LEGACY, "r").attrs["model_config"]), 4 * MiB)), LEGACY_GROUP, LEGACY_IN),
        "its model_config attribute holds 1048"),
    "legacy model_config longer than a configuration can be": (
        lambda d: with_weights(hm.legacy_with_big_config(d / "m.h5", LEGACY, 16 * MiB + 1), LEGACY_GROUP,
                               LEGACY_IN),
        "its model_config attribute is 16.0 MiB, more than a model configuration can be (at most 16.0 MiB); "
        "refused before reading it"),
    "state_dict layer 999999999": (
        lambda d: (hm.state_dict_with_key(d / "in.npz", "weight_ih_l999999999"), ()),
        "missing tensors weight_ih_l3, weight_hh_l3 (an nn.LSTM"),
    "state_dict layer 1 and 30 zeros": (
        lambda d: (hm.state_dict_with_key(d / "in.npz", "weight_ih_l1" + "0" * 30), ()),
        "missing tensors weight_ih_l3, weight_hh_l3"),
    "state_dict layer in Arabic-Indic digits": (
        lambda d: (hm.state_dict_with_key(d / "in.npz", "weight_ih_l\u0669"), ()),
        "is not an nn.LSTM parameter's name"),
    "state_dict layer 999999999, weights apart": (
        lambda d: (hm.torch_inputs(d / "in.npz"), ("--weights", str(hm.state_dict_with_key(
            d / "w.safetensors", "weight_ih_l999999999", inline=False)))),
        "missing tensors weight_ih_l3, weight_hh_l3"),
    ".keras of a million members": (
        lambda d: with_weights(hm.archive_of_many_members(d / "m.keras", RELU), "layers/lstm"),
        "a Keras archive declaring 1000000 members (a model has 3, and a few assets; at most 1000); refused before "
        "reading its directory"),
    "model.weights.h5 and 2 GiB of zeros, deflated": (
        lambda d: with_weights(hm.archive_weights_padded(d / "m.keras", RELU), "layers/lstm"),
        expected(RELU_EXPECTED)),
    "x [500000, 1, 0] with zero-width weights": (
        lambda d: (hm.zero_width_module(d / "in.npz"), ()),
        "x holds no features (input size 0) over 500000 time steps"),
    "no example over a million steps": (lambda d: (hm.empty_batch_problem(d / "in.npz"), ()), zero_gradients),
    "100,001 dangling soft links": (
        lambda d: with_weights(hm.weights_with_dangling_links(d / "w.weights.h5", TWO, 100_001), None,
                               KERAS / "keras_two_layers.in.npz"),
        "its root group holds 100003 links (at most 100000"),  # (and its own two groups)
    "100,001 dangling soft links beside the layer read": (
        lambda d: with_weights(hm.weights_with_dangling_links(d / "w.weights.h5", TWO, 100_001), "layers/lstm_1",
                               KERAS / "keras_two_layers.in.npz"),
        expected(KERAS / "keras_two_layers.expected.npz")),
    "an unused member of 1.6 GB": (
        lambda d: (hm.npz_with_unused_member(d / "in.npz", FIXTURES / "seq_v2_peep.in.npz"), ()),
        expected(FIXTURES / "seq_v2_peep.expected.npz")),
    "assets/readme.txt first": (
        lambda d: with_weights(hm.archive_assets_first(d / "m.keras", RELU), "layers/lstm"),
        expected(RELU_EXPECTED)),
    "lengths 1e20": (
        lambda d: (hm.lengths_of(d / "in.npz", [1e20, 5, 5]), ()),
        "lengths must be in [0, T] = [0, 5], found 5..1e+20"),
    "a 100 KB module name": (
        lambda d: (hm.torch_inputs(d / "in.npz"), ("--weights", str(hm.state_dict_long_prefix(
            d / "w.safetensors")))),
        "...(100000 characters)"),
    "a stored member declaring 4 GB": (
        lambda d: with_weights(hm.archive_stored_size_lie(d / "m.keras", RELU), "layers/lstm"),
        "its model.weights.h5 is stored (not compressed) in"),
}


def run_case(folder: Path, command: str, path: Path, extra: tuple):
    """(exit code, stdout, stderr, peak MB, what is left in its TMPDIR) of one command on one case."""
    tmp = folder / f"tmp-{command}"
    tmp.mkdir()
    if command == "seq":
        args = ["seq", str(path), *extra, "-o", str(folder / "out" / "g.npz")]
    else:
        args = ["inspect", str(path), *extra, "--json"]
    code, stdout, stderr, peak = run_measured(args, folder / "out", file_size=FILE_LIMIT, env={"TMPDIR": str(tmp)})
    return code, stdout, stderr, peak, sorted(os.listdir(tmp))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case built, then met by `seq` and `inspect --json`, two at a time: name -> (folder, fingerprint before,
    {command: (exit code, stdout, stderr, MB, left in TMPDIR)})."""
    built = {name: (folder, path, extra, fingerprint(folder), fingerprint(path))
             for name, (folder, path, extra) in build_cases(tmp_path_factory.mktemp("hostile-models"), CASES).items()}
    runs = [(name, command) for name in CASES for command in ("seq", "inspect")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda run: run_case(built[run[0]][0], run[1], *built[run[0]][1:3]), runs))
    out = {name: (folder, before, source, {}) for name, (folder, _, _, before, source) in built.items()}
    for (name, command), result in zip(runs, results, strict=True):
        out[name][3][command] = result
    return out, {name: built[name][1] for name in built}


@pytest.mark.slow  # (every case run by real commands: the outcomes fixture, ~12 s)
def test_the_cases_are_small_on_disk(outcomes):
    _, inputs = outcomes
    for name, path in inputs.items():
        folder = path.parent
        used = sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())
        assert used < 20 * MiB, (name, used)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_crafted_model_file_is_refused_in_one_line_or_computed_right(outcomes, name):
    results, _ = outcomes
    folder, before, source_before, runs = results[name]
    want = CASES[name][1]
    code, stdout, stderr, peak, left = runs["seq"]
    assert peak < PEAK_MB, f"seq: peak RSS {peak:.0f} MB"
    assert "Traceback" not in stdout + stderr and not left, (stderr, left)
    out = folder / "out" / "g.npz"
    if isinstance(want, str):
        assert code == 1, (code, stderr)
        assert stderr.startswith("Error: ") and stderr.count("\n") == 1, stderr
        assert want in stderr, stderr
        assert len(stderr) < 2000, len(stderr)  # (a long name is cut, saying so)
        assert not out.exists()
    else:
        assert code == 0, stderr
        want(out)
    code, stdout, stderr, peak, left = runs["inspect"]
    assert peak < PEAK_MB, f"inspect: peak RSS {peak:.0f} MB"
    assert "Traceback" not in stdout + stderr and not left, (stderr, left)
    doc = json.loads(stdout)  # one JSON document, whatever the file
    refused = doc.get("exit_code") == 1 or not doc["result"]["ok"]
    assert refused == isinstance(want, str) and code == (1 if refused else 0), (code, stdout[:2000])
    assert fingerprint(folder) != {} and fingerprint(folder)  # (still there)
    assert {k: v for k, v in before.items() if "/out" not in k and "/tmp-" not in k} == {
        k: v for k, v in fingerprint(folder).items() if "/out" not in k and "/tmp-" not in k}


def test_a_heap_object_of_size_0_is_walked_past(tmp_path):
    """A weights file whose global heap has an object of size 0 before the layers' names: HDF5 reading a name
    after it loops forever, beyond SIGTERM (the interpreter never gets the signal); lstmgrad reads the names from
    the heap itself, in a bounded walk.  inspect lists the layers, seq without a group names them."""
    weights = hm.weights_with_empty_heap_object(tmp_path / "w.weights.h5", TWO)
    code, stdout, stderr, peak = run_measured(["inspect", str(weights), "--json"], tmp_path)
    assert code == 0 and peak < PEAK_MB, stderr
    assert [layer["group"] for layer in json.loads(stdout)["result"]["framework_layers"]] == ["layers/lstm",
                                                                                                "layers/lstm_1"]
    code, _, stderr, _ = run_measured(["seq", str(KERAS / "keras_two_layers.in.npz"), "--weights", str(weights), "-o",
                                       str(tmp_path / "g.npz")], tmp_path)
    assert code == 1 and "holds LSTM layers at layers/lstm, layers/lstm_1" in stderr, stderr


def test_a_padded_weights_member_serves_a_batch_without_a_copy(tmp_path):
    """The archive whose model.weights.h5 is followed by 2 GiB of deflated zeros, as --weights of three inputs run
    by two workers: each computed right, no file written past FILE_LIMIT (no copy of the member), nothing left."""
    weights = hm.archive_weights_padded(tmp_path / "m.keras", RELU)
    inputs = []
    for k in range(3):
        inputs.append(tmp_path / f"in{k}.npz")
        shutil.copyfile(RELU_IN, inputs[-1])
    (tmp_path / "tmp").mkdir()
    code, _, stderr, peak = run_measured(
        ["seq", *map(str, inputs), "--weights", str(weights), "--weights-group", "layers/lstm", "--out-dir",
         str(tmp_path / "out"), "--workers", "2"], tmp_path, file_size=FILE_LIMIT,
        env={"TMPDIR": str(tmp_path / "tmp")})
    assert code == 0 and "Traceback" not in stderr, stderr
    assert peak < PEAK_MB and not os.listdir(tmp_path / "tmp")
    for k in range(3):
        expected(RELU_EXPECTED)(tmp_path / "out" / f"in{k}.grads.npz")


# -- what Keras itself accepts -------------------------------------------------------------------------------

VERDICTS = json.loads((KERAS / "config_verdicts.json").read_text())["verdicts"]
# Values Keras takes by their truth (any JSON value where it writes a boolean): lstmgrad refuses them rather than
# guess what the file meant.
NOT_BOOLEANS = {"go_backwards 'yes'", "go_backwards null", "return_sequences 'x'", "unroll 'x'"}


@pytest.mark.parametrize("name", list(EDITS))
def test_a_configuration_keras_refuses_is_refused(runner, tmp_path, name):
    """Every edit of keras_config_edits.py: refused where Keras refuses it; where Keras loads it and it changes
    nothing the layer computes, the fixture's gradients (or, for a value Keras reads by its truth, a refusal)."""
    kind, edit = EDITS[name]
    archive, inputs, gradients, group = SOURCES[kind]
    members = hm.archive_members(KERAS / archive)
    path = hm.write_archive(tmp_path / "m.keras", edited_archive_bytes(members, kind, edit))
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / inputs), "--weights", str(path), "--weights-group", group,
                                  "-o", str(out)])
    assert "Traceback" not in result.output and result.exit_code in (0, 1), result.output
    verdict = VERDICTS[name]
    if verdict["keras"] == "refuses" or name in NOT_BOOLEANS:
        assert result.exit_code == 1 and result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, (
            verdict, result.output)
    elif verdict["neutral"]:
        assert result.exit_code == 0, result.stderr
        expected(KERAS / gradients)(out)
    doc = json.loads(runner.invoke(main, ["inspect", str(path), "--json"]).stdout)
    if verdict["keras"] == "refuses" and "result" in doc:  # inspect of the archive alone refuses the layer too
        report = doc["result"]
        assert not report["ok"] or any(layer.get("refused") for layer in report["framework_layers"]), report


def test_the_verdicts_are_of_every_edit():
    assert set(VERDICTS) == set(EDITS)


# -- fuzzed ---------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=8),
              st.sampled_from(["GRU", "LSTM", "tanh", "hard_sigmoid", "concat", "layers", "config", "class_name"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)


def nodes(value, path=()):
    """Every (path, value) of a JSON document."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from nodes(item, (*path, key))
    elif isinstance(value, list):
        for k, item in enumerate(value):
            yield from nodes(item, (*path, k))


@st.composite
def mutated_config(draw, config: dict) -> dict:
    """``config`` with 1-3 of its nodes replaced by any JSON value, removed, or given a new key."""
    config = json.loads(json.dumps(config))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in nodes(config) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = config
        for step in path[:-1]:
            parent = parent[step]
        how = draw(st.sampled_from(["replace", "remove", "add"]))
        if how == "replace":
            parent[path[-1]] = draw(json_values)
        elif how == "remove":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(json_values)
    return config


def problem_or_refusal(inputs: Path, weights: Path, group: str):
    """load_problem's contract on a crafted --weights: a problem or an LstmGradError, in bounded time and memory;
    and inspect_file's: a report or an LstmGradError."""
    with watchdog(), traced_peak() as peak:
        try:
            load_problem(inputs, weights=weights, weights_group=group)
        except LstmGradError as err:
            assert "\n" not in str(err), str(err)
        try:
            inspect_file(weights)
        except LstmGradError:
            pass
    assert peak[0] < 100 * MiB, peak[0]


@pytest.mark.slow  # (~3 s: one of the slowest fuzz tests)
@fuzz(short=60)
@given(data=st.data(), kind=st.sampled_from(sorted(SOURCES)))
def test_mutated_keras_configurations_give_a_problem_or_one_line(tmp_path_factory, data, kind):
    archive, inputs, _, group = SOURCES[kind]
    members = hm.archive_members(KERAS / archive)
    config = data.draw(mutated_config(json.loads(members["config.json"])), label="config")
    path = hm.write_archive(tmp_path_factory.mktemp("fuzz") / "m.keras",
                            {**members, "config.json": json.dumps(config).encode()})
    problem_or_refusal(KERAS / inputs, path, group)


@fuzz(short=30)
@given(data=st.data())
def test_mutated_legacy_model_configurations_give_a_problem_or_one_line(tmp_path_factory, data):
    config = data.draw(mutated_config(json.loads(h5py.File(LEGACY, "r").attrs["model_config"])), label="config")
    path = hm.legacy_with_config(tmp_path_factory.mktemp("fuzz") / "m.h5", LEGACY,
                                 text=json.dumps(config).encode())
    problem_or_refusal(LEGACY_IN, path, LEGACY_GROUP)


@fuzz(short=40)
@given(data=st.data())
def test_mutated_keras_archives_give_a_problem_or_one_line(tmp_path_factory, data):
    from test_fuzz import mutated

    blob = data.draw(mutated(RELU.read_bytes()), label="archive")
    path = tmp_path_factory.mktemp("fuzz") / "m.keras"
    path.write_bytes(blob)
    problem_or_refusal(RELU_IN, path, "layers/lstm")


layer_numbers = st.one_of(st.integers(0, 4).map(str), st.sampled_from(["00", "01", "999999999", "1" + "0" * 30,
                                                                         "\u0669", "\u0661", "1\u0660", "9" * 5000]))
state_dict_names = st.builds(
    lambda prefix, stem, number, reverse: f"{prefix}{stem}_l{number}{'_reverse' if reverse else ''}",
    st.sampled_from(["", "rnn.", "m" * 300 + ".", "a.b.", "rnn/"]),
    st.sampled_from(["weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"]), layer_numbers, st.booleans())


@fuzz(short=60)
@given(names=st.lists(state_dict_names, max_size=6, unique=True), batch_first=st.booleans())
def test_any_state_dict_names_give_a_problem_or_one_line(tmp_path_factory, names, batch_first):
    """The nn.LSTM fixture's state_dict with more parameters under any names (layer numbers huge, with leading
    zeros or in other scripts' digits, behind long prefixes): computed or refused in one line, in bounded memory
    (a layer number is never a count of layers to make)."""
    inputs, weights = hm.torch_module()
    tensors = {**inputs, **weights, **{name: weights["weight_ih_l1"] for name in names}}
    path = tmp_path_factory.mktemp("fuzz") / "in.npz"
    np.savez(path, **tensors)
    options = frameworks.FrameworkOptions(batch_first=batch_first)
    with watchdog(), traced_peak() as peak:
        try:
            load_problem(path, framework=options)
        except LstmGradError as err:
            message = str(err)
            assert "\n" not in message and len(message) < 3000, message[:300]
        report = inspect_file(path)
        json.dumps(report.to_json())
    assert peak[0] < 100 * MiB, peak[0]


# -- the readers' bounds, one at a time ----------------------------------------------------------------------

def test_json_is_counted_before_it_is_parsed():
    """Depth and values, counted in linear time: an escaped quote does not end a string (a regular expression
    took minutes on ``"\\"\\"\\"...``), brackets in strings are not nesting."""
    text = b'{"a": "' + b'\\"[' * 2_000_000 + b'"}'
    assert io._common.json_extent(text) == (1, 3)  # (the object, its key, its value)
    with pytest.raises(LstmGradError, match="holds 1000002 JSON values"):  # (the list and its numbers)
        io._common.json_document(b"[" + b"0, " * 1_000_000 + b"0]", "x", 10, 500_000)
    with pytest.raises(LstmGradError, match="nests 300 levels deep"):
        io._common.json_document(b"[" * 300 + b"]" * 300, "x", 200, 500_000)


def test_a_variable_length_attribute_is_measured_without_being_read(tmp_path):
    """model_config as Keras writes it (a variable-length string): its length is read from its attribute message,
    in the old object header format and the new one, in the first chunk or a continuation."""
    text = json.dumps(json.loads(h5py.File(LEGACY, "r").attrs["model_config"])).encode()
    # (file format, attributes before it: 20 put it in a continuation chunk of the old format's header, and in
    # the new format's dense storage, a heap this does not read: the file is small enough to read it anyway)
    for libver, before, found in (("earliest", 0, True), ("earliest", 20, True), ("latest", 3, True),
                                  ("latest", 20, False)):
        path = tmp_path / f"{libver}-{before}.h5"
        with h5py.File(path, "w", libver=libver) as fh:
            for k in range(before):
                fh.attrs[f"a{k}"] = "x" * 50
            fh.attrs["model_config"] = text
            fh.create_dataset("d", data=np.zeros(3))
        with h5py.File(path, "r") as fh:
            length = io.hdf5.attribute_bytes(fh, "model_config", path)
        assert length == (len(text) if found else None), (libver, before, length)
        assert keras_archive.hdf5_model_config(path)[0] == json.loads(text)


def test_a_keras_archive_first_member_need_not_be_its_own(tmp_path):
    path = hm.archive_assets_first(tmp_path / "m.keras", RELU)
    assert io.sniff_format(path) == "keras"
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.zeros(3))
    assert io.sniff_format(plain) == "npz"


def test_a_member_twice_is_refused(runner, tmp_path):
    members = [*hm.archive_members(RELU).items()]
    with pytest.warns(UserWarning, match="Duplicate name"):
        path = hm.write_archive(tmp_path / "m.keras", [*members, ("config.json", b"{}")])
    result = runner.invoke(main, ["seq", str(RELU_IN), "--weights", str(path), "--weights-group", "layers/lstm", "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "the archive holds config.json twice" in result.stderr, result.output


def test_inspect_of_a_state_dict_with_a_parameter_twice_says_seq_refuses_it(runner, tmp_path):
    """inspect of the weights file alone names the two spellings that seq --weights-group refuses (it suggested that
    command, with 0 errors)."""
    weights = hm.state_dict_twice_under_group(tmp_path / "twice.safetensors")
    result = runner.invoke(main, ["inspect", str(weights), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and not doc["result"]["ok"], result.stdout
    assert any("both rnn.weight_ih_l0 and rnn/weight_ih_l0 are rnn.weight_ih_l0" in problem["message"]
               for problem in doc["result"]["problems"]), doc["result"]["problems"]


def test_a_compressed_weights_member_is_read_up_to_its_hdf5_end(runner, tmp_path):
    """An archive zipped again (model.weights.h5 deflated, inflated in memory) computes as the stored one."""
    path = hm.write_archive(tmp_path / "m.keras", hm.archive_members(RELU), zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("model.weights.h5").compress_type == zipfile.ZIP_DEFLATED
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(RELU_IN), "--weights", str(path), "--weights-group", "layers/lstm", "-o",
                                  str(out)])
    assert result.exit_code == 0, result.stderr
    expected(RELU_EXPECTED)(out)


def test_npy_files_one_name_twice_by_case(tmp_path, runner):
    folder = tmp_path / "tensors"
    folder.mkdir()
    np.save(folder / "x.npy", np.zeros((2, 1, 1), np.float32))
    (folder / "x.NPY").write_bytes((folder / "x.npy").read_bytes())
    result = runner.invoke(main, ["seq", str(folder), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "both x.NPY and x.npy hold x" in result.stderr, result.output


def test_lengths_past_any_integer_are_refused_without_numpys_warning(tmp_path, runner, recwarn):
    result = runner.invoke(main, ["seq", str(hm.lengths_of(tmp_path / "in.npz", [1e20, 5, 5])), "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "1e+20" in result.stderr, result.stderr
    assert not [w for w in recwarn if "cast" in str(w.message)]


def test_two_spellings_of_one_tensor_are_refused(runner, tmp_path):
    """A name twice after normalisation, whichever way a reader spells it: a Keras weight under two of its
    aliases, a scalar parameter as a dataset and an attribute of one group."""
    weights = tmp_path / "w.weights.h5"
    shutil.copyfile(TWO, weights)
    with h5py.File(weights, "r+") as fh:
        fh["layers/lstm_1/lstm_cell/kernel"] = np.zeros(fh["layers/lstm_1/cell/vars/0"].shape, np.float32)
    result = runner.invoke(main, ["seq", str(KERAS / "keras_two_layers.in.npz"), "--weights", str(weights),
                                  "--weights-group", "layers/lstm_1", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "both cell/vars/0 and lstm_cell/kernel are the layer's kernel" in result.stderr
    with np.load(FIXTURES / "seq_v2_peep.in.npz") as data:
        tensors = {k: data[k] for k in data.files}
    with h5py.File(tmp_path / "in.h5", "w") as fh:
        for key, value in tensors.items():
            fh[key] = value
        fh.attrs["seq_len_max"] = tensors["seq_len_max"]
    result = runner.invoke(main, ["seq", str(tmp_path / "in.h5"), "-o", str(tmp_path / "g.h5")])
    assert result.exit_code == 1 and "seq_len_max is both a dataset and an attribute" in result.stderr, result.output
