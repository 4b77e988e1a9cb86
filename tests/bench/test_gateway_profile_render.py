"""The LiteLLM bench's profile section: before / after side by side, one frame per cell."""

from __future__ import annotations

from bench.server.vs_litellm import frame_group, render_profile


def test_before_and_after_tops_render_side_by_side() -> None:
    tops = {"before": [(17.1, "A.f (a.py:1)"), (9.0, "B.g (b.py:2)")], "after": [(12.5, "A.f (a.py:1)")]}
    text = render_profile(40, tops, n=2)
    lines = text.splitlines()
    assert lines[0].startswith("## Gateway hot path") and "--baseline DIR" in lines[0]
    rows = [line for line in lines if line.startswith("| ") and "%" in line]
    assert rows[0] == "| 17.1 % | `A.f (a.py:1)` | 12.5 % | `A.f (a.py:1)` |"
    assert rows[1] == "| 9.0 % | `B.g (b.py:2)` |  |  |"  # after has no second frame
    assert "*before*" in text


def test_one_gateway_alone_has_one_pair_of_columns() -> None:
    text = render_profile(30, {"after": [(5.0, "F (f.py:3)")]}, n=1)
    assert "--baseline" not in text.splitlines()[0] and "| after: share | frame |" in text


def test_frames_fall_in_their_groups_and_the_groups_render() -> None:
    assert frame_group("_StreamResponseMixin._read (grpc/aio/_call.py:384)").startswith("gRPC client")
    assert frame_group("Buffer.read (grpclib/protocol.py:81)").startswith("gRPC client")
    assert frame_group("H2Connection.receive_data (h2/connection.py:1501)").startswith("gRPC client")
    assert frame_group("_chunk (server/gateway/replicas/engine_client.py:141)").startswith("kvgate")
    assert frame_group("Thread.run (threading.py:982)").startswith("threads")
    assert frame_group("do_execute (sqlalchemy/engine/default.py:1)").startswith("other")
    text = render_profile(30, {"after": [(5.0, "F (f.py:3)")]}, n=1,
                          groups={"after": {frame_group("x (uvicorn/a.py:1)"): 12.25}})
    assert "| HTTP server (uvicorn) | 12.2 % |" in text and "| event loop (asyncio / uvloop) | 0.0 % |" in text
