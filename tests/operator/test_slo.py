"""spec.slo and spec.<role>.scaling.signals: from the LLMService to the ServingConfig and on
to the Ray Serve autoscaling policy of each worker role; the CRD schema checks them."""

from __future__ import annotations

import pytest
import yaml
from k8s_helpers import CRD_FILE, validate_schema

from kvmesh.serve.config import ServingConfig
from kvmesh_operator.mapping import to_serving_config
from kvmesh_operator.spec import SpecError, parse_spec


def _schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_slo_reaches_the_serving_config_and_every_worker_roles_policy():
    raw = {"slo": {"ttftSeconds": 0.8, "tpotSeconds": 0.04},
           "prefill": {"scaling": {"minReplicas": 1, "maxReplicas": 4}},
           "decode": {"scaling": {"minReplicas": 1, "maxReplicas": 8}},
           "router": {"scaling": {"minReplicas": 1, "maxReplicas": 2}}}
    validate_schema(raw, _schema())
    cfg = to_serving_config(parse_spec(raw), name="chat")
    assert (cfg.slo.ttft_s, cfg.slo.tpot_s) == (0.8, 0.04)
    policies = {d["name"]: d["autoscaling_config"].get("policy") for d in cfg.ray_serve_application()["deployments"]}
    assert policies["router"] is None  # HTTP through Ray's proxy: Ray's own counter sees it
    for role in ("prefill", "decode"):
        assert policies[role]["policy_kwargs"] == {"role": role, "ttft_s": 0.8, "tpot_s": 0.04}


def test_defaults_are_kvmeshs_and_ongoing_requests_opts_out():
    cfg = to_serving_config(parse_spec({"decode": {"scaling": {"minReplicas": 1, "maxReplicas": 3,
                                                               "signals": "ongoing_requests"}}}))
    assert cfg.slo == ServingConfig().slo
    assert cfg.decode.autoscaling.signals == "ongoing_requests"
    assert "policy" not in cfg.deployment_overrides()[1]["autoscaling_config"]


@pytest.mark.parametrize("slo", [{"ttftSeconds": 0}, {"tpotSeconds": -0.1}])
def test_non_positive_targets_are_rejected_by_the_crd_and_the_operator(slo):
    with pytest.raises(Exception, match="ttftSeconds|tpotSeconds|0"):
        validate_schema({"slo": slo}, _schema())
    with pytest.raises(SpecError, match=r"spec\.slo\.(ttftSeconds|tpotSeconds)"):
        parse_spec({"slo": slo})
