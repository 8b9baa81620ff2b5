"""A flag whose optional package is missing stops the server before it loads anything, with one line naming the
flag and the install command and exit code 2 (:mod:`epdserve.entry.extras`), for every extra a server flag needs
(through ``epdserve <server>`` itself: :data:`STARTS`). Absence is simulated by a ``None`` entry in ``sys.modules``
(what ``import`` then raises ImportError for), so the checks run wherever the packages are installed too."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from epdserve.config import DecodeConfig, EncoderConfig, LaunchConfig, PrefillConfig
from epdserve.entry.cli import main
from epdserve.entry.extras import MissingExtra, check_extras


def _absent(monkeypatch, *modules: str) -> None:
    for name in modules:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def _present(monkeypatch, name: str) -> None:
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))


@pytest.mark.parametrize("config,modules,flag,extra", [
    (PrefillConfig(grpc_port=31000), ["smg_grpc_proto"], "--grpc-port", "epdserve[smg-grpc]"),
    (DecodeConfig(grpc_port=31000, grpc_protocol="tokenspeed"), ["smg_grpc_proto"], "--grpc-protocol tokenspeed",
     "epdserve[smg-grpc]"),
    (EncoderConfig(bootstrap_port=31001), ["smg_grpc_proto"], "--bootstrap-port", "epdserve[smg-grpc]"),
    (PrefillConfig(kv_transfer="nixl"), ["nixl", "epdserve.kvcache.engine_nixl"], "--kv-transfer nixl",
     "epdserve[nixl]"),
    (DecodeConfig(kv_transfer="mooncake"), ["mooncake", "epdserve.kvcache.engine_mooncake"],
     "--kv-transfer mooncake", "epdserve[mooncake]"),
    (LaunchConfig(kv_transfer="nixl"), ["nixl", "epdserve.kvcache.engine_nixl"], "--kv-transfer nixl",
     "epdserve[nixl]"),
    (PrefillConfig(device="cuda"), ["flashinfer"], "--attention-backend", "epdserve[gpu]"),
    (LaunchConfig(device="cuda:1"), ["flashinfer"], "--attention-backend", "epdserve[gpu]"),
])
def test_a_missing_extra_names_its_flag_and_install(monkeypatch, config, modules, flag, extra):
    _absent(monkeypatch, *modules)
    with pytest.raises(MissingExtra) as e:
        check_extras(config)
    line = str(e.value)
    assert "\n" not in line and flag in line and f"pip install '{extra}" in line, line


def test_the_hybrid_kernels_on_cuda_and_the_sdpa_opt_out(monkeypatch, tiny_qwen3_5_path, tiny_model_path):
    _present(monkeypatch, "flashinfer")
    _absent(monkeypatch, "fla")
    with pytest.raises(MissingExtra, match=r"Qwen3.5.*epdserve\[hybrid-gpu\].*--attention-backend sdpa"):
        check_extras(PrefillConfig(model_path=tiny_qwen3_5_path, device="cuda"))
    check_extras(PrefillConfig(model_path=tiny_model_path, device="cuda"))  # not hybrid: fla not needed
    check_extras(PrefillConfig(model_path=tiny_qwen3_5_path, device="cuda", attention_backend="sdpa"))
    _absent(monkeypatch, "flashinfer")
    check_extras(DecodeConfig(device="cuda", attention_backend="sdpa"))
    check_extras(DecodeConfig(device="cpu"))  # the CPU needs neither


def test_nothing_asked_for_needs_nothing(monkeypatch):
    _absent(monkeypatch, "smg_grpc_proto", "nixl", "mooncake", "flashinfer", "fla", "epdserve.kvcache.engine_nixl",
            "epdserve.kvcache.engine_mooncake")
    for config in (PrefillConfig(device="cpu"), DecodeConfig(device="cpu", kv_transfer="zmq"), EncoderConfig(),
                   LaunchConfig(device="cpu")):
        check_extras(config)


# One server start per extra: (subcommand and flags, modules made absent, modules made present, the flag the line
# names, the extras its install command names). MODEL / HYBRID stand for the tiny Qwen2.5-VL / Qwen3.5 checkpoints.
STARTS = {
    "smg-grpc": (["prefill", "MODEL", "--grpc-port", "31000"], ["smg_grpc_proto"], [], "--grpc-port",
                 ["smg-grpc"]),
    "tokenspeed": (["decode", "MODEL", "--grpc-port", "31000", "--grpc-protocol", "tokenspeed"], ["smg_grpc_proto"],
                   [], "--grpc-protocol tokenspeed", ["smg-grpc"]),
    "encoder-rooms": (["encoder", "MODEL", "--bootstrap-port", "31001"], ["smg_grpc_proto"], [], "--bootstrap-port",
                      ["smg-grpc"]),
    "nixl": (["prefill", "MODEL", "--kv-transfer", "nixl"], ["nixl", "epdserve.kvcache.engine_nixl"], [],
             "--kv-transfer nixl", ["nixl"]),
    "mooncake": (["decode", "MODEL", "--kv-transfer", "mooncake"], ["mooncake", "epdserve.kvcache.engine_mooncake"],
                 [], "--kv-transfer mooncake", ["mooncake", "mooncake-cpu"]),
    "launch-nixl": (["launch", "MODEL", "--kv-transfer", "nixl"], ["nixl", "epdserve.kvcache.engine_nixl"], [],
                    "--kv-transfer nixl", ["nixl"]),
    "gpu": (["prefill", "MODEL", "--device", "cuda"], ["flashinfer"], [], "--attention-backend", ["gpu"]),
    "hybrid-gpu": (["decode", "HYBRID", "--device", "cuda"], ["fla"], ["flashinfer"], "Qwen3.5", ["hybrid-gpu"]),
}


@pytest.mark.parametrize("name", sorted(STARTS))
def test_the_server_stops_with_one_line_and_code_2(monkeypatch, capsys, request, name):
    argv, absent, present, flag, extras = STARTS[name]
    _absent(monkeypatch, *absent)
    for module in present:
        _present(monkeypatch, module)
    paths = {"MODEL": "tiny_model_path", "HYBRID": "tiny_qwen3_5_path"}
    server, model, *flags = argv
    lm = ["--port", "0", "--zmq-port", "0"] if server in ("prefill", "decode") else []
    device = [] if "--device" in flags else ["--device", "cpu"]
    code = main([server, "--model-path", request.getfixturevalue(paths[model]), *device, *lm, *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith(f"epdserve {server}: ") and flag in err, err
    for extra in extras:
        assert f"'epdserve[{extra}]'" in err, err
    assert "pip install" in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_every_server_imports_without_any_extra():
    """The base install (no extra) imports every server, the launcher and every protocol package: an optional
    package loads only when a flag asks for it (a fresh interpreter, where none of them is loaded yet)."""
    extras = ["smg_grpc_proto", "nixl", "mooncake", "flashinfer", "fla", "openai", "tritonclient"]
    modules = ["epdserve.entry.cli", "epdserve.entry.launch", "epdserve.gateway.app", "epdserve.encoder.server",
               "epdserve.prefill.server", "epdserve.decode.server", "epdserve.prefill.http_front",
               "epdserve.decode.http_front", "epdserve.frontend.sglang.service",
               "epdserve.frontend.tokenspeed.service", "epdserve.encoder.tokenspeed"]
    code = (f"import importlib, sys\nsys.modules.update(dict.fromkeys({extras!r}))\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
