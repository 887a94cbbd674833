"""A workshop room in two real Chromium pages (app --auth --presenter): the follower shows the
presenter's average after a move, computed once; switched off it stays; switched on it jumps. The
same server checks the logins and that it listens on loopback only."""
import time

import pytest
from test_browser import small_pool_server

from devtools import browser
from devtools.bench_room import HOST, HOST_PW, ROOM, ROOM_PW, room_states, signed_in


@pytest.fixture(scope="module")
def room(tmp_path_factory):
    extra = ["--auth", f"{ROOM}:{ROOM_PW}", "--presenter", f"{HOST}:{HOST_PW}"]
    for _, url, _ in small_pool_server(tmp_path_factory.mktemp("roompool"), extra):
        yield url


def until(check, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError("the page did not get there")


def test_a_follower_mirrors_the_presenter_detaches_and_jumps_back(room):
    from playwright.sync_api import sync_playwright

    url = room
    http = signed_in(url, ROOM, ROOM_PW)

    def forwards():
        return next(room_states(http, url))["forwards"]

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser.CHROMIUM, headless=True, args=browser.CHROMIUM_FLAGS)
        presenter = browser.signed_in_page(b, url, HOST, HOST_PW)
        follower = browser.signed_in_page(b, url, ROOM, ROOM_PW)
        assert until(lambda: "Following the presenter" in follower.locator("#room-banner").inner_text())
        assert not follower.locator("#ask-box").is_visible() and not presenter.locator("#follow").is_visible()

        before = forwards()
        browser.type_lambda(presenter, 0.8)
        shown = until(lambda: (s := browser.shown(follower))["params"] == {"lam": 0.8} and s)
        time.sleep(1.0)  # whatever the follower's page would compute, it has
        assert shown["average"] == browser.shown(presenter)["average"]
        assert forwards() - before == 1  # the presenter's move, computed once for both pages

        follower.locator("#follow input").uncheck()
        assert until(lambda: "Exploring on your own" in follower.locator("#room-banner").inner_text())
        browser.type_lambda(presenter, 0.5)
        until(lambda: browser.shown(presenter)["params"] == {"lam": 0.5})
        time.sleep(1.0)
        assert browser.shown(follower)["params"] == {"lam": 0.8}  # detached: it stays

        follower.locator("#follow input").check()
        jumped = until(lambda: (s := browser.shown(follower))["params"] == {"lam": 0.5} and s)
        assert jumped["average"] == browser.shown(presenter)["average"]
        b.close()


def test_the_room_needs_a_login_and_listens_on_loopback_only(room):
    import socket
    from urllib.parse import urlparse

    import gradio_client

    with pytest.raises(Exception):
        gradio_client.Client(room, verbose=False).predict(
            "task_arithmetic", 0.3, None, None, None, None, "live", api_name="/evaluate")
    for user, password in ((ROOM, ROOM_PW), (HOST, HOST_PW)):  # the room's login, and the presenter's
        client = gradio_client.Client(room, auth=(user, password), verbose=False)
        assert client.predict("task_arithmetic", 0.3, None, None, None, None, "live", api_name="/evaluate")["spec"]
    port = urlparse(room).port
    ips = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)} - {"127.0.0.1", "::1"}
    for ip in ips:  # bound to loopback only: other interfaces refuse
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=2)
