"""Screenshots of the web console (docs/img/console-*.png), taken in Debian's chromium.

Starts what ``kvgate serve --dev`` starts, on loopback ports and a throwaway SQLite
registry: the CPU reference engine (child process) and the serving app on uvicorn. Seeds
a pool, a retention class and two tenants through the admin API, sends them real
traffic (a RAG-shaped mix whose documents overflow the GPU tier, so the miss-ratio curve
has a shape), then signs in to the console with Selenium and saves each main page.

    PYTHONPATH=. python bench/server/console_screens.py [--out docs/img]

Needs ``chromium`` and ``chromedriver`` on PATH (Debian: chromium, chromium-driver).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
TPB, PRIMARY, SECONDARY = 16, 96, 32
TOPICS = ("drills", "hammers", "saws", "ladders", "paint", "glue", "screws", "tiles")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def document(topic: str) -> str:
    return (f"Catalogue notes on {topic}: our {topic} come in three ranges (basic, pro, industrial). Each range "
            f"has its own warranty and its own return rules; the pro range of {topic} is the best seller. ") * 3


def serve(tmp: Path, admin_token: str, engine_port: int, port: int):
    import uvicorn

    from server.gateway.services import LoopIntervals
    from server.serving import build_serving_app
    from server.settings import Settings
    from tenants import migrate

    url = f"sqlite:///{tmp / 'registry.db'}"
    migrate.upgrade(url=url)
    settings = Settings(database_url=url, admin_tokens=[f"docs:{admin_token}"], key_pepper="docs-" + secrets.token_hex(20),
                        mrc_sample_rate=1.0)
    app = build_serving_app(settings, intervals=LoopIntervals(pool_poll=0.5, usage_flush=0.5))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    return server, thread


def seed(base: str, admin_token: str, engine_port: int) -> dict[str, str]:
    h = {"Authorization": f"Bearer {admin_token}"}
    api = httpx.Client(base_url=base + "/admin/v1", headers=h, timeout=60)
    api.post("/pools", json={"name": "reference", "model_name": MODEL, "engine_spec": "reference-smollm2",
                             "replicas": [{"name": "r0", "endpoint": f"127.0.0.1:{engine_port}"}],
                             "tokens_per_block": TPB, "primary_blocks": PRIMARY, "secondary_blocks": SECONDARY,
                             "secondary_offload_min_priority": 35}).raise_for_status()
    api.post("/retention-classes", json={"name": "gold", "context_priority": 60}).raise_for_status()
    api.put("/pools/reference/slo", json={"ttft_p99_ms": 4000, "window_seconds": 30, "min_requests": 10}).raise_for_status()
    keys = {}
    for slug, name, quota in (("acme", "Acme Hardware", 0.5), ("globex", "Globex Support", 0.25)):
        api.post("/tenants", json={"slug": slug, "display_name": name, "pool": "reference", "retention_class": "gold",
                                   "kv_quota_fraction": quota}).raise_for_status()
        keys[slug] = api.post(f"/tenants/{slug}/keys", json={"name": "production"}).json()["key"]
    api.post("/pools/reference/captures", json={"sample_rate": 0.5, "tenant": "acme"}).raise_for_status()
    return keys


def traffic(base: str, keys: dict[str, str], rounds: int) -> None:
    client = httpx.Client(base_url=base + "/v1", timeout=180)
    for i in range(rounds):
        for slug, key in keys.items():
            topic = TOPICS[(i * 3 + len(slug)) % (len(TOPICS) if slug == "acme" else 3)]
            client.post("/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
                "model": MODEL, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": f"You answer questions for {slug}. {document(topic)}"},
                             {"role": "user", "content": f"Question {i % 4} about {topic}?"}]}).raise_for_status()


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1360,1000",
                "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def shoot(driver, path: Path) -> None:
    # Why the device metrics: a headless window is capped at its screen's height; the override is not.
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 1360, "height": 700, "deviceScaleFactor": 1,
                                                                  "mobile": False})
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 1360, "height": max(700, min(2400, height)),
                                                                  "deviceScaleFactor": 1, "mobile": False})
    time.sleep(0.3)
    driver.save_screenshot(str(path))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--rounds", type=int, default=16, help="requests per tenant")
    args = parser.parse_args(argv)
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        print("console_screens: needs chromium and chromedriver (Debian: chromium, chromium-driver)", file=sys.stderr)
        return 2
    from selenium.webdriver.common.by import By

    from server.demo import ReferencePoolShape
    from server.engine_process import start_engine, stop_engine

    args.out.mkdir(parents=True, exist_ok=True)
    engine_port, port, admin_token = free_port(), free_port(), "docs-" + secrets.token_hex(16)
    shape = ReferencePoolShape(port=engine_port, tokens_per_block=TPB, primary_blocks=PRIMARY, secondary_blocks=SECONDARY)
    engine_args = [*shape.engine_args(), "--max-input-len", "1024", "--max-output-len", "16", "--max-batch-size", "4"]
    engine = start_engine(engine_args, port=engine_port, timeout=600, progress=print)
    with tempfile.TemporaryDirectory() as tmp:
        server, thread = serve(Path(tmp), admin_token, engine_port, port)
        base = f"http://127.0.0.1:{port}"
        driver = None
        try:
            keys = seed(base, admin_token, engine_port)
            traffic(base, keys, args.rounds)
            time.sleep(1.5)  # one more stats poll
            driver = browser()
            driver.get(base + "/console/signin")
            shoot(driver, args.out / "console-signin.png")
            driver.find_element(By.ID, "token").send_keys(admin_token)
            driver.find_element(By.CSS_SELECTOR, "#signin button[type=submit]").click()
            for page, name in (("/console/pools", "pools"), ("/console/pools/reference", "pool"),
                               ("/console/tenants", "tenants"), ("/console/tenants/acme", "tenant")):
                driver.get(base + page)
                time.sleep(0.5)
                shoot(driver, args.out / f"console-{name}.png")
            driver.find_element(By.CSS_SELECTOR, "#create-key input[name=name]").send_keys("staging")
            driver.find_element(By.CSS_SELECTOR, "#create-key button[type=submit]").click()
            time.sleep(0.5)
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 1360, "height": 640,
                                                                          "deviceScaleFactor": 1, "mobile": False})
            driver.save_screenshot(str(args.out / "console-new-key.png"))
            print(f"wrote {args.out / 'console-new-key.png'}")
        finally:
            if driver is not None:
                driver.quit()
            server.should_exit = True
            thread.join(30)
            stop_engine(engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
