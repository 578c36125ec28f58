"""Uploads in parts, as OpenAI's Uploads API takes them, through the API under gunicorn with Redis and SeaweedFS real:
a part lost to a dropped connection and sent again (not the file), parts sent out of order and joined in the order
named, and each refusal a caller can mend leaving the upload to mend."""

from __future__ import annotations

import hashlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from storage.uploads import NotPending, UploadStatus, UploadStore

from .conftest import UPLOAD_LIMIT, MiB, auth, padded
from .test_api import assert_problem

KEY = "parts"
PHONE_CLIP = "forensics-VID_20191220_170832.mp4"  # a real phone clip, 2.9 MB: three parts of 1 MiB


@pytest.fixture(scope="module")
def video(corpus_cache) -> bytes:
    return (corpus_cache / PHONE_CLIP).read_bytes()


def declare(api: str, size: int, key: str = KEY, **fields) -> requests.Response:
    body = {"bytes": size, "filename": "phone.mp4", "mime_type": "video/mp4", "purpose": "user_data", **fields}
    return requests.post(f"{api}/v1/uploads", json=body, headers=auth(key), timeout=10)


def declared(api: str, size: int) -> str:
    response = declare(api, size)
    assert response.status_code == 201, response.text
    assert response.json()["status"] == "pending" and response.json()["file"] is None
    return response.json()["id"]


def send_part(api: str, upload_id: str, data: bytes, key: str = KEY) -> requests.Response:
    files = {"data": ("blob", data, "application/octet-stream")}  # as OpenAI's SDK sends a part
    return requests.post(f"{api}/v1/uploads/{upload_id}/parts", files=files, headers=auth(key), timeout=30)


def sent(api: str, upload_id: str, data: bytes) -> str:
    response = send_part(api, upload_id, data)
    assert response.status_code == 201, response.text
    assert response.json()["object"] == "upload.part" and response.json()["upload_id"] == upload_id
    return response.json()["id"]


def complete(api: str, upload_id: str, part_ids: list[str], key: str = KEY, **fields) -> requests.Response:
    body = {"part_ids": part_ids, **fields}
    return requests.post(f"{api}/v1/uploads/{upload_id}/complete", json=body, headers=auth(key), timeout=60)


def get(api: str, upload_id: str, key: str = KEY) -> requests.Response:
    return requests.get(f"{api}/v1/uploads/{upload_id}", headers=auth(key), timeout=10)


def thirds(data: bytes) -> list[bytes]:
    step = len(data) // 3 + 1
    return [data[at : at + step] for at in range(0, len(data), step)]


def parts_left(s3, upload_id: str) -> list[str]:
    return list(s3.keys(f"uploads/{KEY}/parts/{upload_id}/"))


def drop_mid_part(api: str, upload_id: str, data: bytes) -> None:
    """Sends a part's request head and half its body, then closes the connection: a client whose network went."""
    boundary = "dropped-part"
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"data\"; filename=\"blob\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + data + f"\r\n--{boundary}--\r\n".encode()
    address = urlsplit(api)
    head = (
        f"POST /v1/uploads/{upload_id}/parts HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Authorization: {auth(KEY)['Authorization']}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(head + body[: len(body) // 2])


def test_a_part_lost_to_a_dropped_connection_is_sent_again_not_the_file(api, s3, video):
    """A 2.9 MB phone clip in three parts; the second's connection drops halfway. The upload keeps the first part,
    stores nothing of the lost one, takes the second again and joins the file byte for byte."""
    upload_id = declared(api, len(video))
    first, second, third = thirds(video)
    part_ids = [sent(api, upload_id, first)]
    drop_mid_part(api, upload_id, second)
    deadline = time.monotonic() + 10  # the API notices the connection gone as it reads the body
    while len(parts_left(s3, upload_id)) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(parts_left(s3, upload_id)) == 1, "the lost part's bytes were kept"
    shown = get(api, upload_id).json()
    assert (shown["status"], shown["received_bytes"], shown["part_ids"]) == ("pending", len(first), part_ids)

    part_ids += [sent(api, upload_id, second), sent(api, upload_id, third)]
    response = complete(api, upload_id, part_ids, md5=hashlib.md5(video).hexdigest())
    assert response.status_code == 200, response.text
    done = response.json()
    assert (done["status"], done["bytes"], done["part_ids"]) == ("completed", len(video), part_ids)
    assert done["sha256"] == hashlib.sha256(video).hexdigest() and done["file"]["id"] == upload_id
    with s3.open(done["key"]) as stored:
        assert stored.read() == video
    assert parts_left(s3, upload_id) == [], "the parts stayed beside the file they make"
    assert get(api, upload_id).json() == done


def test_parts_sent_at_once_in_any_order_are_joined_inside_storage_in_the_order_named(api, s3, video):
    """Parts of S3's size (5 MiB and more, the last apart) are joined by storage itself, not read through the API:
    the file is the same bytes, and its sha256 is the worker's to find, unless an md5 asked for a read."""
    big = padded(video, UPLOAD_LIMIT - 1024)
    pieces = [big[at : at + 6 * MiB] for at in range(0, len(big), 6 * MiB)]
    for md5 in (None, hashlib.md5(big).hexdigest()):
        upload_id = declared(api, len(big))
        with ThreadPoolExecutor(2) as pool:  # the last part first: each request lands when it lands
            part_ids = list(pool.map(lambda piece: sent(api, upload_id, piece), pieces[::-1]))[::-1]
        done = complete(api, upload_id, part_ids, md5=md5)
        assert done.status_code == 200, done.text
        with s3.open(done.json()["key"]) as stored:
            assert hashlib.sha256(stored.read()).digest() == hashlib.sha256(big).digest()
        assert done.json()["sha256"] == (md5 and hashlib.sha256(big).hexdigest())


def test_a_completion_refused_leaves_the_upload_to_mend(api, s3, video):
    """A part missing, a part unknown, a wrong md5: each answers what is wrong, and the upload still takes parts."""
    upload_id = declared(api, len(video))
    first, second, third = thirds(video)
    part_ids = [sent(api, upload_id, first), sent(api, upload_id, second)]

    missing = assert_problem(complete(api, upload_id, part_ids), 422, "upload_incomplete")
    assert missing["error"]["param"] == "part_ids" and f"declared {len(video)}" in missing["detail"]
    unknown = assert_problem(complete(api, upload_id, [*part_ids, "part_" + "0" * 24]), 422, "invalid_parts")
    assert "part_" + "0" * 24 in unknown["detail"]
    part_ids.append(sent(api, upload_id, third))  # mended
    wrong = assert_problem(complete(api, upload_id, part_ids, md5="0" * 32), 422, "md5_mismatch")
    assert hashlib.md5(video).hexdigest() in wrong["detail"]
    assert get(api, upload_id).json()["status"] == "pending" and not s3.exists(f"uploads/{KEY}/{upload_id}")
    done = complete(api, upload_id, part_ids)
    assert done.status_code == 200, done.text

    # The SDK retries a completion whose answer it lost: the same parts answer the same upload; others are refused
    assert complete(api, upload_id, part_ids).json() == done.json()
    assert_problem(complete(api, upload_id, part_ids, md5="0" * 32), 422, "md5_mismatch")  # checked again
    assert_problem(complete(api, upload_id, part_ids[:2]), 409, "upload_completed")
    assert_problem(send_part(api, upload_id, b"more"), 409, "upload_completed")
    assert_problem(requests.post(f"{api}/v1/uploads/{upload_id}/cancel", headers=auth(KEY), timeout=10), 409,
                   "upload_completed")  # fmt: skip


def test_an_upload_in_parts_is_bounded_as_one_sent_whole(api, s3, video):
    assert_problem(declare(api, UPLOAD_LIMIT + 1), 413, "upload_too_large")  # before a byte of it is sent
    refused = assert_problem(declare(api, 10, bytes=0, filename=""), 422, "invalid_request")
    assert {item["field"] for item in refused["errors"]} == {"bytes", "filename"}
    assert_problem(declare(api, 10, expires_after={"anchor": "created_at", "seconds": 60}), 422, "invalid_request")
    for odd in ({"bytes": "100"}, {"bytes": True}, {"mime_type": "not a type"}, {"filename": "a\r\nb.mp4"}):
        assert_problem(declare(api, 10, **odd), 422, "invalid_request")

    upload_id = declared(api, 1000)
    assert_problem(send_part(api, upload_id, video[:1001]), 413, "upload_too_large")  # larger than the upload
    assert_problem(send_part(api, upload_id, b""), 422, "input_empty")
    json_part = requests.post(f"{api}/v1/uploads/{upload_id}/parts", json={"data": "x"}, headers=auth(KEY), timeout=10)
    assert_problem(json_part, 415, "unsupported_media_type")
    assert parts_left(s3, upload_id) == [] and get(api, upload_id).json()["received_bytes"] == 0

    # Another key's upload answers as a missing one, whatever is asked of it
    sent(api, upload_id, video[:1000])
    for response in (
        get(api, upload_id, key="bob"),
        send_part(api, upload_id, b"x", key="bob"),
        complete(api, upload_id, ["part_" + "0" * 24], key="bob"),
        requests.post(f"{api}/v1/uploads/{upload_id}/cancel", headers=auth("bob"), timeout=10),
    ):
        assert_problem(response, 404, "upload_not_found")
    shown = get(api, upload_id).json()
    assert (shown["status"], shown["received_bytes"]) == ("pending", 1000)  # bob's cancel cancelled nothing


def test_a_part_sent_again_after_its_answer_was_lost_does_not_block_the_upload(api, s3, video):
    """OpenAI's SDK sends a part again when its answer times out, though the first may have landed: both are kept
    (only the parts named at completion count), up to twice the upload's bytes in all."""
    upload_id = declared(api, 1000)
    first, again = sent(api, upload_id, video[:600]), sent(api, upload_id, video[:600])
    assert_problem(send_part(api, upload_id, video[:900]), 413, "upload_too_large")  # 2,100 of at most 2,000
    rest = sent(api, upload_id, video[600:1000])
    done = complete(api, upload_id, [again, rest], md5=hashlib.md5(video[:1000]).hexdigest())
    assert done.status_code == 200, done.text
    assert first not in done.json()["part_ids"] and parts_left(s3, upload_id) == []


def test_a_cancelled_upload_drops_its_parts_and_a_pending_one_is_named_as_such(api, s3, video):
    upload_id = declared(api, len(video))
    sent(api, upload_id, video[:1000])
    named = requests.post(f"{api}/v1/videos", json={"upload_id": upload_id}, headers=auth(KEY), timeout=10)
    assert "/complete" in assert_problem(named, 409, "upload_not_completed")["detail"]

    (part_id,) = get(api, upload_id).json()["part_ids"]
    by_key = {"input_key": f"uploads/{KEY}/parts/{upload_id}/{part_id}"}  # one part of it is no video either
    named = requests.post(f"{api}/v1/videos", json=by_key, headers=auth(KEY), timeout=10)
    assert_problem(named, 404, "upload_not_found")

    cancel = requests.post(f"{api}/v1/uploads/{upload_id}/cancel", headers=auth(KEY), timeout=10)
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
    assert parts_left(s3, upload_id) == []
    assert requests.post(f"{api}/v1/uploads/{upload_id}/cancel", headers=auth(KEY), timeout=10).json() == cancel.json()
    assert_problem(send_part(api, upload_id, video[:10]), 409, "upload_cancelled")
    assert_problem(complete(api, upload_id, ["part_" + "0" * 24]), 409, "upload_cancelled")
    named = requests.post(f"{api}/v1/videos", json={"upload_id": upload_id}, headers=auth(KEY), timeout=10)
    assert "send the file again" in assert_problem(named, 409, "upload_cancelled")["detail"]


def test_a_song_sent_in_parts_is_refused_as_its_parts_are_joined(api, s3, corpus_cache):
    for name, said in (("hachoir-marc_kravetz.mp3", "MP3 audio"), ("pymediainfo-mp4-with-audio.mp4", "sound only")):
        song = (corpus_cache / name).read_bytes()
        upload_id = declared(api, len(song))
        part_ids = [sent(api, upload_id, piece) for piece in thirds(song)]
        refused = assert_problem(complete(api, upload_id, part_ids), 422, "input_no_video")
        assert said in refused["detail"] and "phone.mp4" in refused["detail"]
        assert not s3.exists(f"uploads/{KEY}/{upload_id}")


def test_an_upload_sent_whole_answers_as_a_completed_one(api, s3, video, redis_client):
    response = requests.post(
        f"{api}/v1/uploads", files={"file": ("phone.mp4", video, "video/mp4")}, headers=auth(KEY), timeout=30
    )
    assert response.status_code == 201, response.text
    whole = response.json()
    assert (whole["status"], whole["bytes"], whole["file"]["id"]) == ("completed", len(video), whole["id"])
    assert whole["sha256"] == hashlib.sha256(video).hexdigest() and whole["filename"] == "phone.mp4"
    assert get(api, whole["id"]).json() == whole
    s3.delete(whole["key"])  # gone within its time (an operator): no such upload to a job
    named = requests.post(f"{api}/v1/videos", json={"upload_id": whole["id"]}, headers=auth(KEY), timeout=10)
    assert_problem(named, 404, "upload_not_found")
    redis_client.hset(f"vsrq:upload:{whole['id']}", "expires_at", 0)  # no job named it within its TTL: swept
    assert get(api, whole["id"]).json()["status"] == "expired"  # what `vsrq bulk` asks before naming it again
    named = requests.post(f"{api}/v1/videos", json={"upload_id": whole["id"]}, headers=auth(KEY), timeout=10)
    assert "send the file again" in assert_problem(named, 409, "upload_expired")["detail"]  # as GET says: not 404


def test_a_pending_upload_expires_and_then_takes_nothing(redis_client):
    store = UploadStore(redis_client, ttl_s=1, prefix="vsrq-test-expiry")
    store.create("upload_" + "e" * 24, "me", filename="a.mp4", size=10, mime_type="video/mp4", purpose=None)
    store.add_part("upload_" + "e" * 24, "part_" + "1" * 24, 5)
    time.sleep(1.1)
    assert store.get("upload_" + "e" * 24, "me").status is UploadStatus.EXPIRED
    for attempt in (
        lambda: store.add_part("upload_" + "e" * 24, "part_" + "2" * 24, 5),
        lambda: store.begin_complete("upload_" + "e" * 24),
    ):
        with pytest.raises(NotPending) as refused:
            attempt()
        assert refused.value.status is UploadStatus.EXPIRED


def test_a_completion_sent_again_while_the_first_joins_waits_for_it(api, redis_client, video):
    """OpenAI's SDK gives up on a completion's answer after its timeout and sends it again while the first still
    joins the parts: the second waits (it answered 409 at once, which the SDK raised), and where the first ends
    without completing, does the join itself."""
    upload_id = declared(api, len(video))
    part_ids = [sent(api, upload_id, piece) for piece in thirds(video)]
    first = UploadStore(redis_client, ttl_s=3600)
    token = first.begin_complete(upload_id)  # a request joining its parts

    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(complete, api, upload_id, part_ids)
        time.sleep(1.5)
        assert not second.done(), second.result().text
        first.reopen(upload_id, token)  # the first ends without completing (its client's fault, or its process killed)
        done = second.result(timeout=30)
    assert done.status_code == 200 and done.json()["status"] == "completed", done.text


def test_a_completion_whose_process_died_lets_another_take_over_once_its_hold_lapses(redis_client):
    """Its hold renewed while it joins; once its renewals stop (its process killed), the upload takes parts, a cancel
    or another completion again, and the dead one's late end changes nothing of the one that took over."""
    store, upload_id = UploadStore(redis_client, ttl_s=60, prefix="vsrq-test-hold", hold_s=1), "upload_" + "h" * 24
    store.create(upload_id, "me", filename="a.mp4", size=10, mime_type="video/mp4", purpose=None)
    dead = store.begin_complete(upload_id)
    with store.holding(upload_id, dead):  # alive: renewed while it joins, however long
        time.sleep(2)
        with pytest.raises(NotPending) as held:
            store.add_part(upload_id, "part_" + "1" * 24, 5)
        assert held.value.status is UploadStatus.COMPLETING
    time.sleep(1.2)  # its renewals stopped, as a killed process's do
    assert store.get(upload_id, "me").status is UploadStatus.PENDING
    store.add_part(upload_id, "part_" + "1" * 24, 10)
    alive = store.begin_complete(upload_id)
    store.reopen(upload_id, dead)  # the dead one's failure, late
    assert not store.completed(upload_id, dead, ["part_" + "1" * 24], None)
    assert store.get(upload_id, "me").status is UploadStatus.COMPLETING
    assert store.completed(upload_id, alive, ["part_" + "1" * 24], None)
    assert store.get(upload_id, "me").status is UploadStatus.COMPLETED


def test_an_expired_upload_says_so_to_a_job_and_to_a_cancel(api, redis_client, video):
    upload_id = declared(api, len(video))
    redis_client.hset(f"vsrq:upload:{upload_id}", "expires_at", 0)  # its day has passed
    assert get(api, upload_id).json()["status"] == "expired"
    named = requests.post(f"{api}/v1/videos", json={"upload_id": upload_id}, headers=auth(KEY), timeout=10)
    assert "send the file again" in assert_problem(named, 409, "upload_expired")["detail"]
    cancel = requests.post(f"{api}/v1/uploads/{upload_id}/cancel", headers=auth(KEY), timeout=10)
    assert_problem(cancel, 409, "upload_expired")
