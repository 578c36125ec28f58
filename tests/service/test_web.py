"""The web app in Debian's headless Chromium (driven by Playwright, never a downloaded browser), against the real stack
and a real Celery worker: a person enters the key, drops a real MP4 with audio, watches the job reach 100 %, compares
before and after, plays and downloads the result, cancels and deletes a job. What is asserted is what they would see.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import av
import pytest
import requests
from PIL import Image

from worker.media.synthetic import write_clip

from .conftest import KEYS, auth, padded, serve_api
from .test_worker import worker  # noqa: F401  (its lanczos worker fixture serves this module too)

CHROMIUM = "/usr/bin/chromium"
KEY = "web"
# What the brief for CI asks of the browser: nothing reaches out, nothing is kept between runs (a fresh profile).
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
SIZE = (144, 256)  # height, width: big enough for a person to see the comparison
IDLE_QUEUE = "vsrq.web-idle"  # no worker takes it: the open API's jobs stay queued


@pytest.fixture(scope="module")
def open_api(service_env, tmp_path_factory) -> Iterator[str]:
    """The API as `vsrq dev` serves it: auth off on loopback. Its anonymous owner is its first key's id: one of its own,
    so its listing holds only the jobs its tests made (other modules make jobs as `alice` meanwhile)."""
    keys = [{"id": "web-open", "token": f"sk-test-web-open-{'0' * 16}"}]
    env = {
        **service_env, "VSRQ_AUTH": "none", "VSRQ_API_KEYS": json.dumps(keys),
        "VSRQ_MODELS": json.dumps({"lanczos": IDLE_QUEUE}),
    }  # fmt: skip
    with serve_api(env, tmp_path_factory.mktemp("open-api") / "gunicorn.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory) -> Iterator:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing: CI must install Debian's chromium (.ci/run does)")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); CI runs this test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"),  # --user-data-dir: a fresh one
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 1000},
            accept_downloads=True,
        )
        try:
            yield context
        finally:
            context.close()


def drop(page, selector: str, path: Path, kind: str = "video/mp4") -> None:
    """Drops the file on the element as a person's drag and drop does: a `drop` event carrying it."""
    transfer = page.evaluate_handle(
        """([data, name, kind, changed]) => {
            const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, {type: kind, lastModified: changed}));
            return transfer;
        }""",
        [base64.b64encode(path.read_bytes()).decode(), path.name, kind, path.stat().st_mtime_ns // 1_000_000],
    )
    page.dispatch_event(selector, "drop", {"dataTransfer": transfer})


def watch_upload_text(page) -> None:
    """Keeps what the upload's progress text said, as it changed, in `window.uploadTexts`."""
    page.evaluate(
        """() => {
            const text = document.getElementById("upload-text");
            window.uploadTexts = [];
            new MutationObserver(() => window.uploadTexts.push(text.textContent))
                .observe(text, {childList: true, characterData: true, subtree: true});
        }"""
    )


def route_parts(page, drops: Callable[[int], bool]) -> list[str]:
    """The URL of each part the page sends, in order; the n-th (from 1) has its connection reset where `drops(n)`."""
    sent: list[str] = []

    def part(route) -> None:
        sent.append(route.request.url)
        if drops(len(sent)):
            route.abort("connectionreset")
        else:
            route.continue_()

    page.route("**/v1/uploads/*/parts", part)
    return sent


def signed_in(browser_context, api: str):
    """A new page of the web app, signed in with the test's key (it may be remembered from an earlier test), and the
    page errors it raises as they come."""
    page = browser_context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(f"{api}/")
    until(page, "!document.getElementById('connect').hidden || !document.getElementById('workspace').hidden")
    if page.locator("#connect").is_visible():  # run alone, the key was not remembered by the test before
        page.get_by_role("textbox", name="API key").fill(KEYS[KEY])
        page.get_by_role("button", name="Connect").click()
    return page, problems


def until(page, expression: str, timeout_s: float = 20) -> None:
    """Waits for a JS expression to hold. (Playwright's own waiting evaluates strings with eval(), which the page's
    Content-Security-Policy rightly forbids.)"""
    for _ in range(int(timeout_s / 0.05)):
        if page.evaluate(expression):
            return
        page.wait_for_timeout(50)
    raise AssertionError(f"still false after {timeout_s} s: {expression}")


@pytest.mark.usefixtures("worker")
def test_a_person_upscales_compares_downloads_cancels_and_deletes(api, browser_context, jobs, tmp_path):
    from playwright.sync_api import expect

    clip = write_clip(tmp_path / "holiday.mp4", 48, SIZE, audio_codec="aac")
    page = browser_context.new_page()
    problems: list[str] = []
    page.on("console", lambda message: message.type == "error" and problems.append(message.text))
    page.on("pageerror", lambda error: problems.append(str(error)))
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))

    # -- connect: a wrong key is refused, the right one opens the workspace
    page.goto(f"{api}/")
    expect(page.get_by_role("heading", name="Connect with your API key")).to_be_visible()
    page.screenshot(path=str(tmp_path / "connect.png"))
    page.get_by_role("textbox", name="API key").fill("sk-not-a-key-000000000000")
    page.get_by_role("button", name="Connect").click()
    expect(page.get_by_text("This key was not accepted.")).to_be_visible()
    problems.clear()  # the browser logs the refused request itself
    page.get_by_role("textbox", name="API key").fill(KEYS[KEY])
    page.get_by_role("button", name="Connect").click()
    expect(page.get_by_role("heading", name="Upscale a video")).to_be_visible()
    expect(page.get_by_text("No jobs yet. Drop a video to start.")).to_be_visible()

    # -- drop a real MP4 with audio; the page reads its size and says what comes out
    page.get_by_label("Model", exact=True).select_option("lanczos")
    drop(page, "#dropzone", clip)
    expect(page.locator("#picked-name")).to_have_text("holiday.mp4")
    height, width = SIZE
    expect(page.locator("#picked-info")).to_contain_text(f"{width}×{height}")
    expect(page.locator("#out-size")).to_have_text(f"Output {2 * width}×{2 * height}")
    watch_upload_text(page)
    page.get_by_role("button", name="Upscale", exact=True).click()

    # -- the job appears and its progress climbs to 100 %
    row = page.locator("li.job", has_text="holiday.mp4")
    expect(row).to_be_visible()
    seen: list[int] = []
    bar = row.get_by_role("progressbar")
    deadline = time.monotonic() + 120  # generous: CI's two cores are shared by the whole suite
    while time.monotonic() < deadline:
        seen.append(int(bar.get_attribute("aria-valuenow") or 0))
        if row.locator(".badge").inner_text() in ("Completed", "Failed", "Cancelled"):
            break
        page.wait_for_timeout(50)
    expect(row.locator(".badge")).to_have_text("Completed", timeout=5000)
    expect(bar).to_have_attribute("aria-valuenow", "100")
    expect(row.locator(".job-stage")).to_have_text(re.compile(r"^Done in \d+:\d\d$"))
    expect(row.locator(".job-meta")).to_contain_text(f"2× · lanczos · {width}×{height} → {2 * width}×{2 * height}")
    assert seen == sorted(seen), f"progress went back: {seen}"
    upload_texts = page.evaluate("window.uploadTexts")
    assert any(text.startswith("Uploading 100 %") for text in upload_texts), upload_texts

    # -- before / after: both play, in sync, the result at twice the size
    row.get_by_role("button", name="Compare").click()
    compare = page.locator("#compare")
    expect(compare.get_by_role("heading", name="Before / after")).to_be_visible()
    expect(page.locator("#before-size")).to_have_text(f"{width}×{height}")
    expect(page.locator("#after-size")).to_have_text(f"{2 * width}×{2 * height}")
    expect(page.locator("#no-before")).to_be_hidden()
    until(page, "['before', 'after'].every((id) => document.getElementById(id).readyState >= 2)")
    sizes = page.evaluate("['before', 'after'].map((id) => document.getElementById(id).videoWidth)")
    assert sizes == [width, 2 * width], sizes
    compare.get_by_role("button", name="Play").click()
    until(page, "document.getElementById('after').currentTime > 0.5")
    playing = page.evaluate(
        "['before', 'after'].map((id) => { const v = document.getElementById(id); return [v.paused, v.currentTime]; })"
    )
    assert not playing[0][0] and not playing[1][0], playing
    assert abs(playing[0][1] - playing[1][1]) < 0.3, f"before and after drifted apart: {playing}"
    page.locator("#split").fill("35")
    assert page.evaluate("getComputedStyle(document.querySelector('.pane.after')).clipPath") == "inset(0px 0px 0px 35%)"
    compare.get_by_role("button", name="Pause").click()
    expect(page.locator("#clock")).to_contain_text("/ 0:02")
    screenshot = tmp_path / "web.png"
    page.screenshot(path=str(screenshot), full_page=True)
    print(f"\nscreenshots: {tmp_path}/{{connect,web,side}}.png")
    compare.get_by_text("Side by side").click()
    before_box, after_box = (page.locator(f"#{side}").bounding_box() for side in ("before", "after"))
    assert before_box["x"] + before_box["width"] <= after_box["x"] and before_box["y"] == after_box["y"]
    compare.screenshot(path=str(tmp_path / "side.png"))

    # -- download: the MP4 the service made, with its audio
    with page.expect_download() as download:
        row.get_by_role("button", name="Download").click()
    assert download.value.suggested_filename == "holiday-x2.mp4"
    saved = tmp_path / "downloaded.mp4"
    download.value.save_as(saved)
    with av.open(str(saved)) as container:
        assert (container.streams.video[0].width, container.streams.video[0].height) == (2 * width, 2 * height)
        assert len(container.streams.audio) == 1

    # -- its history: the job's events, oldest first
    row.get_by_role("button", name="History").click()
    steps = row.locator(".job-history li")
    expect(steps.first).to_contain_text("Created")
    expect(steps.last).to_contain_text("Completed")
    expect(row.locator(".job-history")).to_contain_text("Attempt 1 started")
    expect(row.get_by_role("button", name="History")).to_have_attribute("aria-expanded", "true")
    row.get_by_role("button", name="History").click()
    expect(row.locator(".job-history")).to_be_hidden()

    # -- a job no worker serves waits in its queue: the person cancels it, then deletes it
    page.get_by_label("Model", exact=True).select_option("k6-vsr")
    drop(page, "#dropzone", clip)
    page.get_by_role("button", name="Upscale", exact=True).click()
    waiting = page.locator("li.job[data-status='queued']")
    expect(waiting.locator(".job-stage")).to_have_text(re.compile(r"Queued · (next up|\d+ ahead)"))
    job_id = waiting.get_attribute("data-id")
    # were a worker to take it and die, its history says so, and how many more attempts it has
    jobs.lease(job_id, "gone@host/1", 60)
    jobs.take_back([job_id])
    waiting = page.locator(f"li.job[data-id='{job_id}']")
    expect(waiting).to_have_attribute("data-status", "queued")
    waiting.get_by_role("button", name="History").click()
    expect(waiting.locator(".job-history")).to_contain_text(
        "Attempt 1 ended: the worker running the attempt died and was started again, which took the job back "
        "(worker_restarted); it will run again (2 more may end so before it fails)"
    )
    waiting.get_by_role("button", name="Cancel").click()
    cancelled = page.locator(f"li.job[data-id='{job_id}']")
    expect(cancelled.locator(".badge")).to_have_text("Cancelled")
    page.once("dialog", lambda dialog: dialog.accept())
    cancelled.get_by_role("button", name="Delete").click()
    expect(cancelled).to_have_count(0)
    assert requests.get(f"{api}/v1/videos/{job_id}", headers=auth(KEY), timeout=30).status_code == 404

    # -- a reload keeps the key (remembered) and the original (IndexedDB): the comparison still has both sides
    page.reload()
    expect(row.locator(".badge")).to_have_text("Completed")
    # by keyboard: the comparison takes the focus (it stayed in the list, 82 Tabs from Play), Escape gives it back
    row.get_by_role("button", name="Compare").press("Enter")
    expect(compare.get_by_role("button", name="Play")).to_be_focused()
    expect(page.locator("#no-before")).to_be_hidden()
    until(page, "document.getElementById('before').readyState >= 2")
    page.keyboard.press("Escape")
    expect(compare).to_be_hidden()
    expect(row.get_by_role("button", name="Compare")).to_be_focused()

    assert not [url for url in urls if KEYS[KEY] in url], "the API key went into a URL"
    assert problems == [], problems


@pytest.mark.usefixtures("worker")
def test_a_person_asks_for_a_frame_per_field_and_reads_what_ran(api, browser_context, tmp_path):
    """The advanced settings reach the job and the job's notes reach the person: an interlaced camcorder clip (H.264,
    top field first, 25 frames a second, with sound) at a frame per field."""
    from playwright.sync_api import expect

    clip = write_clip(tmp_path / "camcorder.mp4", 13, SIZE, Fraction(25), audio_codec="aac",
                      video_options={"x264-params": "interlaced=1:tff=1"})  # fmt: skip
    page, problems = signed_in(browser_context, api)
    expect(page.get_by_role("heading", name="Upscale a video")).to_be_visible()

    page.get_by_label("Model", exact=True).select_option("lanczos")
    # An animated GIF is no video to the browser: the page still reads its size, from its first frame
    sticker = tmp_path / "sticker.gif"
    frames = [Image.new("RGB", (120, 90), (255, 40 * i, 0)) for i in range(4)]
    frames[0].save(sticker, save_all=True, append_images=frames[1:], duration=100)
    drop(page, "#dropzone", sticker, "image/gif")
    expect(page.locator("#picked-info")).to_contain_text("120×90")
    expect(page.locator("#out-size")).to_have_text("Output 240×180")
    # and the file picker offers the animated pictures the service takes (an APNG is named .png)
    assert {".gif", ".png", ".webp", ".avif"} <= set(page.locator("#file").get_attribute("accept").split(","))
    page.get_by_role("button", name="Change").click()

    page.get_by_text("Advanced settings").click()
    page.get_by_label("Interlaced video").select_option("field")
    page.get_by_label("Behind transparency").fill("#ffffff")
    drop(page, "#dropzone", clip)
    expect(page.locator("#picked-name")).to_have_text("camcorder.mp4")
    page.get_by_role("button", name="Upscale", exact=True).click()

    row = page.locator("li.job", has_text="camcorder.mp4")
    expect(row.locator(".badge")).to_have_text("Completed", timeout=120_000)
    notes = row.get_by_role("list", name="Notes on camcorder.mp4")
    expect(notes).to_contain_text("one frame for each field")
    expect(notes).to_contain_text("25 frames/s in, 50 out")
    job = requests.get(f"{api}/v1/videos/{row.get_attribute('data-id')}", headers=auth(KEY), timeout=30).json()
    chosen = (job["params"]["deinterlace"], job["params"]["background"])
    assert chosen == ("field", "#ffffff"), job["params"]
    assert (job["output"]["media"]["frames"], job["output"]["media"]["fps"]) == (26, 50.0), job["output"]["media"]
    page.screenshot(path=str(tmp_path / "notes.png"), full_page=True)
    assert problems == [], problems


@pytest.mark.usefixtures("worker")
def test_the_faster_tier_is_offered_only_for_a_model_whose_workers_have_one(api, browser_context):
    """`lanczos` is a classical upscaler: a `high` job of it runs the exact engine all the same (and says so after the
    fact). The page knows it from the workers registered on its queue (each says its tiers: test_api's
    `..._only_where_a_worker_of_its_queue_runs_it`): for lanczos it offers no "Faster (FP8)" and says why; for k6-vsr,
    no worker of which is registered here, it does."""
    from playwright.sync_api import expect

    for _ in range(200):  # the worker registers once Celery is ready: seconds after its fixture starts it
        served = requests.get(f"{api}/v1/models", headers=auth(KEY), timeout=10).json()["data"]
        if {model["id"]: model["qualities"] for model in served}["lanczos"] == ["lossless"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"no lanczos worker registered: {served}")
    page, problems = signed_in(browser_context, api)
    page.get_by_text("Advanced settings").click()
    model, speed = page.get_by_label("Model", exact=True), page.get_by_label("Speed")
    faster, hint = speed.locator('option[value="high"]'), page.locator("#quality-hint")

    model.select_option("k6-vsr")
    expect(faster).to_be_enabled()
    speed.select_option("high")
    expect(hint).to_contain_text("Faster runs parts of the model in 8-bit floats")
    model.select_option("lanczos")
    expect(faster).to_be_disabled()
    expect(speed).to_have_value("lossless")  # the choice made for k6-vsr is not sent for a model without it
    expect(hint).to_have_text("Faster is not available for lanczos: its workers have no faster path (a classical "
                              "upscaler, or GPUs without 8-bit float arithmetic).")  # fmt: skip
    model.select_option("k6-vsr")
    expect(faster).to_be_enabled()
    expect(hint).to_contain_text("Faster runs parts of the model in 8-bit floats")
    assert problems == [], problems


def test_the_api_docs_render_the_document_from_this_api_alone(api, browser_context, tmp_path):
    from playwright.sync_api import expect

    page = browser_context.new_page()
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    page.goto(f"{api}/docs")
    expect(page.get_by_role("heading", name=re.compile(r"^vsrq"))).to_be_visible()
    expect(page.get_by_text("OAS 3.1")).to_be_visible()
    create = page.locator(".opblock-post", has_text="/v1/videos").first
    expect(create).to_contain_text("Create a job")
    expect(page.get_by_role("button", name="Authorize")).to_be_visible()
    page.screenshot(path=str(tmp_path / "docs.png"))
    print(f"\nscreenshot: {tmp_path / 'docs.png'}")
    assert [url for url in urls if not url.startswith(api)] == [], "the docs page fetched from another host"


def test_with_auth_off_the_page_asks_for_no_key_and_hides_no_job_still_going(open_api, browser_context, tmp_path):
    from playwright.sync_api import expect

    clip = write_clip(tmp_path / "clip.mp4", 8, SIZE).read_bytes()
    upload = requests.post(f"{open_api}/v1/uploads", files={"file": ("clip.mp4", clip, "video/mp4")}, timeout=30)
    made = [
        requests.post(f"{open_api}/v1/videos", json={"upload_id": upload.json()["id"]}, timeout=30).json()["id"]
        for _ in range(53)
    ]
    for job_id in made[1:]:  # the oldest stays queued, 52 newer ones end
        assert requests.post(f"{open_api}/v1/videos/{job_id}/cancel", timeout=30).status_code == 200

    page = browser_context.new_page()
    page.goto(f"{open_api}/")
    expect(page.locator("#workspace")).to_be_visible()
    expect(page.get_by_role("heading", name="Connect with your API key")).to_be_hidden()
    expect(page.get_by_role("button", name="Forget key")).to_be_hidden()
    rows = "document.querySelectorAll('#jobs > li')"
    until(page, f"{rows}.length === 51")  # the newest 50, and the queued one behind them
    shown = [row.get_attribute("data-id") for row in page.locator("#jobs > li").all()]
    assert shown == made[:-51:-1] + made[:1]
    page.get_by_role("button", name="Show older jobs").click()
    until(page, f"{rows}.length === 53")
    assert [row.get_attribute("data-id") for row in page.locator("#jobs > li").all()] == made[::-1]
    expect(page.get_by_role("button", name="Show older jobs")).to_be_hidden()


def test_on_a_phone_a_long_name_stays_on_screen_and_a_song_is_refused_before_its_upload(
    open_api, browser_context, corpus_cache, s3, tmp_path
):
    """One 200-character file name made the page 2,390 px wide on a phone (2,746 on a desktop): every job's buttons
    off-screen. A song was uploaded whole, then failed as no video."""
    from playwright.sync_api import expect

    page = browser_context.new_page()
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{open_api}/")
    drop(page, "#dropzone", corpus_cache / "hachoir-marc_kravetz.mp3", kind="audio/mpeg")
    expect(page.locator("#form-error")).to_have_text(
        "hachoir-marc_kravetz.mp3 is an audio file, not a video: pick a video file."
    )
    expect(page.get_by_role("button", name="Upscale", exact=True)).to_be_disabled()
    page.get_by_role("button", name="Change").click()
    expect(page.locator("#dropzone")).to_be_focused()  # not <body>: a keyboard user goes on from there
    # the service's refusal, in words without the API's backticks ("`notes.mp4` is a text file")
    (tmp_path / "notes.mp4").write_text("Cut at 0:42, keep the ending.\n")
    drop(page, "#dropzone", tmp_path / "notes.mp4")
    page.get_by_role("button", name="Upscale", exact=True).click()
    expect(page.locator("#form-error")).to_have_text("notes.mp4 is a text file, not a video.")
    page.get_by_role("button", name="Change").click()

    long = write_clip(tmp_path / f"{'holiday' * 28}.mp4", 8, SIZE)
    drop(page, "#dropzone", long)
    page.get_by_role("button", name="Upscale", exact=True).click()
    row = page.locator("li.job", has_text="holiday" * 28)
    expect(row.locator(".badge")).to_have_text("Queued")
    try:
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        cancel = row.get_by_role("button", name=f"Cancel {long.name}")  # named after its job for a screen reader
        box = cancel.bounding_box()
        assert 0 <= box["x"] and box["x"] + box["width"] <= 390, box
    finally:  # gone again, so the other test's listing of this owner holds only its own jobs
        job_id = row.get_attribute("data-id")
        assert requests.post(f"{open_api}/v1/videos/{job_id}/cancel", timeout=10).status_code == 200
        assert requests.delete(f"{open_api}/v1/videos/{job_id}", timeout=10).status_code == 200


def test_try_it_out_in_the_docs_creates_a_job(open_api, browser_context, tmp_path):
    from playwright.sync_api import expect

    clip = write_clip(tmp_path / "clip.mp4", 8, SIZE)
    page = browser_context.new_page()
    page.goto(f"{open_api}/docs")
    create = page.locator(".opblock-post", has_text="/v1/videos").first
    create.locator(".opblock-summary").click()  # its form is open to edit at once (`tryItOutEnabled`)
    create.locator("input[type=file]").first.set_input_files(clip)  # the first file field: `input_reference`
    create.get_by_role("button", name="Execute").click()
    answer = create.locator(".live-responses-table tr.response").first
    expect(answer).to_be_visible(timeout=20_000)
    # the form as Swagger UI sends it: `metadata` a JSON blob, no field the form left empty
    sent = create.locator(".curl-command").text_content()
    assert answer.locator(".response-col_status").text_content().strip() == "200", f"{sent}\n{answer.text_content()}"
    [job] = requests.get(f"{open_api}/v1/videos?limit=1", timeout=10).json()["data"]  # the newest: this one
    assert job["input"]["filename"] == "clip.mp4"
    # gone again, so the other test's listing of this owner holds only its own jobs, in either order
    assert requests.post(f"{open_api}/v1/videos/{job['id']}/cancel", timeout=10).status_code == 200
    assert requests.delete(f"{open_api}/v1/videos/{job['id']}", timeout=10).status_code == 200


def test_a_large_video_goes_in_parts_and_a_part_whose_connection_drops_is_sent_again(
    open_api, browser_context, corpus_cache, s3, tmp_path
):
    """A 9.5 MiB phone video (the corpus's, padded by an MP4 `free` box) goes in two parts; the second's connection
    drops as it is sent. The page says so, sends that part again, not the file, and the job names the whole file."""
    from playwright.sync_api import expect

    video = padded((corpus_cache / "forensics-VID_20191220_170832.mp4").read_bytes(), 19 * 1024 * 1024 // 2)
    path = tmp_path / "on the train.mp4"
    path.write_bytes(video)
    page = browser_context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    sent = route_parts(page, lambda nth: nth == 2)
    page.goto(f"{open_api}/")
    page.get_by_label("Model", exact=True).select_option("lanczos")
    drop(page, "#dropzone", path)
    expect(page.locator("#picked-name")).to_have_text("on the train.mp4")
    watch_upload_text(page)
    page.get_by_role("button", name="Upscale", exact=True).click()
    expect(page.get_by_text("Uploaded on the train.mp4.")).to_be_visible(timeout=30_000)

    assert len(sent) == 3 and sent[1] == sent[2], sent  # part 1, part 2 dropped, part 2 again
    texts = page.evaluate("window.uploadTexts")
    assert any(text.startswith("Connection lost sending part 2 of 2") for text in texts), texts
    (job,) = requests.get(f"{open_api}/v1/videos?limit=1", timeout=10).json()["data"]
    upload = requests.get(f"{open_api}/v1/uploads/{job['input']['upload_id']}", timeout=10).json()
    assert (upload["status"], upload["bytes"], job["input"]["filename"]) == ("completed", len(video), path.name)
    with s3.open(upload["key"]) as stored:  # joined inside storage: the parts were S3-sized
        assert hashlib.sha256(stored.read()).digest() == hashlib.sha256(video).digest()
    assert (job["model"], job["params"]["sr_resolution_scale"]) == ("lanczos", 2) and not problems
    requests.post(f"{open_api}/v1/videos/{job['id']}/cancel", timeout=10)


def test_an_upload_in_parts_cut_by_a_reload_resumes_when_the_same_file_is_picked_again(
    open_api, browser_context, corpus_cache, tmp_path
):
    """The second part cannot get through (a captive portal, a dead link) and the person reloads: picking the same
    file again sends only what was missing, to the same upload."""
    from playwright.sync_api import expect

    path = tmp_path / "holiday.mp4"
    path.write_bytes(padded((corpus_cache / "forensics-VID_20191220_170832.mp4").read_bytes(), 19 * 1024 * 1024 // 2))
    page = browser_context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # "Leave site? Changes may not be saved": yes
    blocked = [True]
    sent = route_parts(page, lambda nth: blocked[0] and nth > 1)
    page.goto(f"{open_api}/")
    page.get_by_label("Model", exact=True).select_option("lanczos")
    drop(page, "#dropzone", path)
    page.get_by_role("button", name="Upscale", exact=True).click()
    until(page, "document.getElementById('upload-text').textContent.startsWith('Connection lost sending part 2')")
    page.reload()

    upload_url, blocked[0] = sent[0], False
    sent.clear()
    page.get_by_label("Model", exact=True).select_option("lanczos")
    drop(page, "#dropzone", path)
    page.get_by_role("button", name="Upscale", exact=True).click()
    expect(page.get_by_text("Resuming holiday.mp4: 1 of 2 parts were sent before.")).to_be_visible()
    expect(page.get_by_text("Uploaded holiday.mp4.")).to_be_visible(timeout=30_000)
    assert sent == [upload_url], sent  # the second part only, to the same upload
    (job,) = requests.get(f"{open_api}/v1/videos?limit=1", timeout=10).json()["data"]
    assert job["input"]["upload_id"] in upload_url
    assert page.evaluate("localStorage.getItem('vsrq-uploads')") == "{}"  # nothing left to resume
    requests.post(f"{open_api}/v1/videos/{job['id']}/cancel", timeout=10)


def test_a_cancelled_upload_in_parts_sends_nothing_more_whenever_it_is_cancelled(
    open_api, browser_context, corpus_cache, tmp_path
):
    """Cancelled while it is being declared, or offline mid-part: no part is sent after, and the service's upload is
    cancelled (its parts deleted) once the cancel gets through. Both went on sending, and a job was made."""
    path = tmp_path / "walk.mp4"
    path.write_bytes(padded((corpus_cache / "forensics-VID_20191220_170832.mp4").read_bytes(), 19 * 1024 * 1024 // 2))
    page = browser_context.new_page()
    declared: list[str] = []
    page.on("response", lambda answer: answer.url.endswith("/v1/uploads") and declared.append(answer.json()["id"]))
    held: list = []
    page.route("**/v1/uploads", lambda route: held.append(route))  # the declaration's answer is late
    parts = route_parts(page, lambda nth: False)
    page.goto(f"{open_api}/")
    page.get_by_label("Model", exact=True).select_option("lanczos")

    def cancelled(upload_id: str) -> bool:
        return requests.get(f"{open_api}/v1/uploads/{upload_id}", timeout=10).json()["status"] == "cancelled"

    # -- cancelled while its declaration is on its way
    drop(page, "#dropzone", path)
    page.get_by_role("button", name="Upscale", exact=True).click()
    until(page, "document.getElementById('unpick').textContent === 'Cancel upload'")
    page.wait_for_timeout(200)
    page.get_by_role("button", name="Cancel upload").click()
    held[0].continue_()
    page.unroute("**/v1/uploads")
    for _ in range(100):
        if declared and cancelled(declared[0]):
            break
        page.wait_for_timeout(100)
    assert declared and cancelled(declared[0]) and parts == [], (declared, parts)

    # -- cancelled offline, mid-part; the browser back online
    drop(page, "#dropzone", path)
    page.get_by_role("button", name="Upscale", exact=True).click()
    until(page, "document.getElementById('upload-text').textContent.startsWith('Uploading')")
    browser_context.set_offline(True)
    until(page, "document.getElementById('upload-text').textContent.startsWith('Offline')")
    page.get_by_role("button", name="Cancel upload").click()
    sent_before = len(parts)
    browser_context.set_offline(False)
    for _ in range(100):
        if len(declared) == 2 and cancelled(declared[1]):
            break
        page.wait_for_timeout(100)
    page.wait_for_timeout(1500)  # a part that would have been sent again by now
    assert len(declared) == 2 and cancelled(declared[1]) and len(parts) == sent_before, (declared, parts)
    jobs = requests.get(f"{open_api}/v1/videos?limit=5", timeout=10).json()["data"]
    assert not [job for job in jobs if job["input"]["upload_id"] in declared]
