"""Every bench ends the same way: print its section, and write it between its markers when asked."""

from __future__ import annotations

from bench.report import publish


def test_publish_prints_always_and_writes_only_when_asked(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# kvgate benchmarks\n\n<!-- bench:demo -->\nSTALE\n<!-- /bench:demo -->\n\ntail\n")
    publish("demo", "## Demo\nfresh figures", write=False, path=doc)
    assert "STALE" in doc.read_text() and "## Demo\nfresh figures" in capsys.readouterr().out
    publish("demo", "## Demo\nfresh figures", write=True, path=doc)
    text = doc.read_text()
    assert "STALE" not in text and "<!-- bench:demo -->\n## Demo\nfresh figures\n<!-- /bench:demo -->" in text
    assert text.endswith("tail\n") and "wrote benchmarks.md section bench:demo" in capsys.readouterr().out
