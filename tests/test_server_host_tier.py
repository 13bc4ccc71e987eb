"""``jaxkv-server``'s host tier flags: refused in one line (exit 2) where invalid, and the tier
they configure (a real server with one: ``tests/test_server_cli.py``)."""

import pytest

pytest.importorskip("uvicorn")

from jaxkv.server.cli import offload_config, parser


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--kv_offloading_path", "/tmp/x"], "--kv_offloading_path needs --kv_offloading_size"),
        (["--kv_offloading_size", "1MiB", "--no_prefix_caching"], "needs the prefix cache"),
        (["--kv_offloading_size", "100000GiB"], "--kv_offloading_size=107,374,182,400,000 exceeds this host's"),
        (["--kv_offloading_size", "1MiB", "--kv_offloading_policy", "fifo"], "invalid choice: 'fifo'"),
        (["--kv_offloading_size", "lots"], "'lots' is not a size"),
        (["--kv_offloading_peers", "/tmp/*.kv"], "--kv_offloading_peers needs --kv_offloading_size"),
        (["--kv_offloading_size", "1MiB", "--kv_offloading_peers", "/tmp/*.kv"], "needs --kv_offloading_path"),
    ],
)
def test_a_host_tier_the_server_cannot_have_is_refused_in_one_line(tmp_path, capsys, flags, says):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        offload_config(parser().parse_args(["--checkpoint", str(tmp_path), *flags]), tmp_path)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_the_file_defaults_to_write_through_and_names_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = parser().parse_args(["--checkpoint", str(tmp_path), "--kv_offloading_size", "1MiB"])
    plain = offload_config(args, tmp_path)
    assert plain.host_bytes == 1 << 20 and plain.store == "on_eviction" and plain.path is None
    args = parser().parse_args(
        [*["--checkpoint", str(tmp_path), "--kv_offloading_size", "1MiB"], "--kv_offloading_path", "f"]
    )
    kept = offload_config(args, tmp_path)
    assert kept.store == "write_through" and kept.path == "f" and len(kept.model_id) == 64
    assert kept.peers is None
    shared = offload_config(parser().parse_args([*args_list(tmp_path), "--kv_offloading_peers", "d/*.kv"]), tmp_path)
    assert shared.peers == "d/*.kv" and shared.path == "f"
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert offload_config(args, tmp_path).model_id != kept.model_id


def args_list(tmp_path) -> list[str]:
    return ["--checkpoint", str(tmp_path), "--kv_offloading_size", "1MiB", "--kv_offloading_path", "f"]
