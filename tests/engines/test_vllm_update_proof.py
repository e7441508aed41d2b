"""vLLM's own reload through the router is published only on the weights the trainer named.

Real vLLM servers (the session's pair), a real router. The trainer's digest of a checkpoint is computed
from its tensors (:func:`router.trainer.digests.expected_checksum`, vLLM's rule: fused projections,
per-parameter SHA-256 folded into one); it must equal what the servers report once they hold that
checkpoint. A reload of the old checkpoint with the new one's digest expected (a trainer that loaded the
wrong thing: every engine answers 200 and the fleet agrees with itself) is a 502, fenced, the version not
published, and the servers still generate the old checkpoint's tokens under the old label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from router.contract.weight_digest import EXPECTED_CHECKSUM_HEADER, vllm_digest
from router.trainer.digests import expected_checksum
from tests.engines._vllm_server import VllmServer
from tests.engines.conftest import AUTH, Router, complete, load_checkpoint
from tests.procs import http_json
from worker.model.checkpoint import read_checkpoint

pytestmark = pytest.mark.timeout(900)


def digest_of(checkpoint: Path) -> str:
    """The trainer's digest for these servers: vLLM's CPU build with LoRA on (router.trainer.digests says what
    that covers)."""
    return expected_checksum(read_checkpoint(checkpoint, torch.float32), "vllm", vllm_cpu=True, vllm_lora=True)


def reload(router: Router, checkpoint: Path, expected: str) -> tuple[int, Any]:
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
    headers = AUTH | {EXPECTED_CHECKSUM_HEADER: expected}
    return http_json("POST", router.url + "/collective_rpc", rpc, headers=headers, timeout=300)


def test_a_reload_is_published_only_on_the_digest_the_trainer_named(
    vllm_pair: list[VllmServer], router_for: Any, ckpts: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    router: Router = router_for([s.url for s in vllm_pair], "--policy", "round_robin")
    load_checkpoint(router, ckpts["a"], "a")
    digest_a, digest_b = digest_of(ckpts["a"]), digest_of(ckpts["b"])
    assert digest_a != digest_b
    # The trainer's digest is the engines' own report, folded by the documented rule.
    checked = router.ok("POST", "/weight_checker", {"action": "checksum"})
    assert [vllm_digest(r["body"]["checksums"]) for r in checked["results"]] == [digest_a, digest_a]

    # The wrong checkpoint (A again) while B's weights are expected: every engine answers 200, none is published.
    router.ok("POST", "/pause?mode=keep")
    status, answer = reload(router, ckpts["a"], digest_b)
    assert status == 502, answer
    assert all(r["status_code"] == 200 and not r["success"] for r in answer["results"]), answer
    assert all(f"holds weights {digest_a}, not the expected {digest_b}" in r["error"] for r in answer["results"])
    assert set(answer["digests"].values()) == {digest_a}
    assert all(w["disabled"] for w in router.workers())
    assert router.ok("GET", "/fleet/versions")["weight_version"] == "a"
    router.ok("POST", "/weight_update_journal/resolve", {"acknowledge": True})
    router.ok("POST", "/resume")
    assert [complete(s.url, s.model).tokens for s in vllm_pair] == [reference["a"]] * 2
    assert [http_json("GET", s.url + "/weight_info")[1]["weight_version"] for s in vllm_pair] == ["a", "a"]

    # The right checkpoint with its digest: published.
    router.ok("POST", "/pause?mode=keep")
    status, answer = reload(router, ckpts["b"], digest_b)
    assert status == 200, answer
    assert set(answer["digests"].values()) == {digest_b} and "verification" in answer["timings"]
    router.ok("POST", "/update_weight_version", {"new_version": "b-proved"})
    router.ok("POST", "/resume")
    stamped = complete(router.url, vllm_pair[0].model)
    assert (stamped.tokens, stamped.version) == (reference["b"], "b-proved")
