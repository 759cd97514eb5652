"""vtcampaign: Hydra composition with host-dependent defaults, one-line user errors (exit code 2), and the
read-only commands (status, render, pr) over evidence files."""
from __future__ import annotations

import pytest

from campaigns import records
from campaigns.cli import main
from campaigns.config import CampaignConfigError, compose, options
from campaigns.evidence import load_evidence, save_evidence
from helpers import TPUT_WIN, make_evidence, plain_defaults

CAMPAIGNS = ["async_device_mirror", "async_scheduling", "chunk_above", "chunk_graphs", "chunked_prefill",
             "decode_wave_grid",
             "fast_math", "fuse_norm", "fuse_rope", "fuse_silu", "gqa_swap",
             "marlin_dense",
             "mixed_chunk", "mixed_prefill", "mixed_steps", "nsplits_cap", "pdl", "pdl_prefetch", "pdl_stack",
             "prefill_gqa_pack", "prefill_splits", "split_rule",
             "triton_gemv",
             "w4a16_mid_m", "w4a16_rot", "whole_first"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("vtcampaign: error: ")
    return lines[0]


# ----------------------------------------------------------------------------------------------- compose


def test_every_campaign_composes_on_both_host_kinds():
    assert options("campaign") == CAMPAIGNS
    for name in CAMPAIGNS:
        gpu, cpu = compose([f"campaign={name}"], cuda=True), compose([f"campaign={name}"], cuda=False)
        # a GPU run takes the campaign file's grid where it names one (the levers decided where large batches or
        # long prompts live), else online; grid= on the command line still wins
        own = {"split_rule": "online_wide", "decode_wave_grid": "online_wide", "nsplits_cap": "online_wide",
               "w4a16_mid_m": "online_span", "mixed_chunk": "long_prompt"}.get(name, "online")
        assert (gpu.device, gpu.grid.name, gpu.model.name) == ("cuda", own, "qwen3-8b")
        gpu = compose([f"campaign={name}", "grid=online"], cuda=True)
        assert gpu.grid.name == "online"
        assert (cpu.device, cpu.grid.name, cpu.model.name) == ("cpu", "rehearsal", "tiny")
        # marlin_dense and w4a16_rot act on W4A16 only; pdl is measured where every kernel of the layer is ours
        # (MXFP4), and rehearses in bf16 on CPU, where it is inert anyway
        want = {"marlin_dense": ("mxfp4", "mxfp4"), "w4a16_rot": ("mxfp4", "mxfp4"), "pdl_prefetch": ("mxfp4", "mxfp4"),
                "w4a16_mid_m": ("mxfp4", "mxfp4"), "pdl_stack": ("mxfp4", "mxfp4"),
                "pdl": ("mxfp4", "bf16")}.get(name, ("bf16", "bf16"))
        assert (gpu.model.quant, cpu.model.quant) == want
        assert list(gpu.grid.concurrency) == [1, 2, 4, 8] and list(gpu.grid.prompts_per_leg) == [6, 6, 12, 24]
        assert gpu.grid.reps == 5 and (gpu.grid.input_len, gpu.grid.output_len) == (1024, 128)
        pol = gpu.campaign.policy
        # async_device_mirror is a correctness fix (RED first): it flips on its gates, not on speed
        assert (pol.near_tie_max_mnats, pol.min_gain) == (500, 0.01)
        assert pol.flip_on_correctness == (name == "async_device_mirror")
        assert (gpu.allow_dirty, gpu.commit, gpu.resume, gpu.out_dir) == (False, False, None, "records/campaigns")
        assert gpu.tracking.uri == "sqlite:///mlflow.db"


def test_each_group_file_is_typed_by_its_own_schema(tmp_path):
    """Every campaign, grid, gate and tracking file names its group's schema first (Hydra's structured-config
    pattern), so a project's own group file is checked key by key, and the error names the key and the value."""
    import shutil
    from pathlib import Path
    from hydra.core.config_store import ConfigStore
    from campaigns.config import GROUP_SCHEMAS
    from vtengine import confdirs
    repo = ConfigStore.instance().repo
    for group in GROUP_SCHEMAS:
        assert f"{group}_schema.yaml" in repo[group], group
        for name in options(group):
            text = confdirs.group_files(group)[name].read_text()
            assert f"defaults:\n  - {group}_schema\n  - _self_\n" in text, f"conf/{group}/{name}.yaml"
    conf = tmp_path / "conf"
    shutil.copytree(Path(confdirs.merged()), conf)
    (conf / "grid" / "mine.yaml").write_text("defaults:\n  - grid_schema\n  - _self_\nname: mine\nreps: many\n")
    with pytest.raises(CampaignConfigError, match="bad value for grid.reps: Value 'many'"):
        compose(["campaign=gqa_swap", "grid=mine"], conf_dir=conf, cuda=True)
    (conf / "grid" / "mine.yaml").write_text("defaults:\n  - grid_schema\n  - _self_\nname: mine\nconcurency: [1]\n")
    with pytest.raises(CampaignConfigError, match="unknown key 'grid.concurency'; accepted keys of grid: name, "):
        compose(["campaign=gqa_swap", "grid=mine"], conf_dir=conf, cuda=True)


@pytest.mark.parametrize("traded,match", [
    ("{itl: ''}", r"traded_axes \['itl'\] need the reason the lever trades them"),
    ("{latency: why}",
     r"unknown axis \['latency'\] in campaign.policy.traded_axes; accepted: total_token_throughput"),
    ("{tpot: why}", r"traded_axes \['tpot'\] are primary axes"),
])
def test_traded_axes_must_be_known_explained_and_not_primary(traded, match):
    with pytest.raises(CampaignConfigError, match=match):
        compose(["campaign=gqa_swap", f"+campaign.policy.traded_axes={traded}"], cuda=True)
    cfg = compose(["campaign=gqa_swap", "+campaign.policy.traded_axes={itl: why}"], cuda=True)
    assert dict(cfg.campaign.policy.traded_axes) == {"itl": "why"}


def test_axes_traded_on_one_grid_join_the_policy_there_alone():
    """mixed_prefill trades the median TTFT on the long-prompt grid only; the evidence's policy holds the merged map,
    so its record quotes both reasons; a grid name that is no grid is an error naming the accepted ones."""
    long = compose(["campaign=mixed_prefill", "grid=long_prompt"], cuda=True)
    assert sorted(long.campaign.policy.traded_axes) == ["itl", "p99_itl", "ttft"]
    assert "median E2EL" in long.campaign.policy.traded_axes["ttft"]
    short = compose(["campaign=mixed_prefill"], cuda=True)
    assert sorted(short.campaign.policy.traded_axes) == ["itl"]
    with pytest.raises(CampaignConfigError, match=r"traded_axes_by_grid names unknown grid\(s\) \['longer'\]; "
                                                  r"accepted: long_prompt, online"):
        compose(["campaign=mixed_prefill", "+campaign.policy.traded_axes_by_grid.longer={ttft: why}"], cuda=True)
    with pytest.raises(CampaignConfigError, match=r"traded_axes \['tpot'\] are primary axes"):
        compose(["campaign=mixed_prefill", "grid=long_prompt",
                 "+campaign.policy.traded_axes_by_grid.long_prompt.tpot=why"], cuda=True)


def test_primary_axes_by_grid_replace_the_primary_axes_on_that_grid_alone():
    """mixed_prefill reads the max ITL (the stall itself) in place of the P99 on the long-prompt grid, and trades the
    P99 there; on the standard grid its primary axes stay as declared. A grid or axis that is not known, or an empty
    list, is an error naming what is accepted; so is the flat primary_axes on a grid whose entry would replace it."""
    long = compose(["campaign=mixed_prefill", "grid=long_prompt"], cuda=True)
    assert list(long.campaign.policy.primary_axes) == ["total_token_throughput", "tpot", "max_itl"]
    assert "under 1% of its ~128 gaps" in long.campaign.policy.traded_axes["p99_itl"]
    short = compose(["campaign=mixed_prefill"], cuda=True)
    assert list(short.campaign.policy.primary_axes) == ["total_token_throughput", "tpot", "p99_itl"]
    with pytest.raises(CampaignConfigError, match=r"primary_axes_by_grid names unknown grid\(s\) \['longer'\]; "
                                                  r"accepted: "):
        compose(["campaign=mixed_prefill", "+campaign.policy.primary_axes_by_grid.longer=[tpot]"], cuda=True)
    with pytest.raises(CampaignConfigError, match=r"unknown axis \['p999_itl'\] in campaign.policy.primary_axes_by_grid"
                                                  r".online; accepted: .*max_itl"):
        compose(["campaign=mixed_prefill", "+campaign.policy.primary_axes_by_grid.online=[tpot,p999_itl]"], cuda=True)
    with pytest.raises(CampaignConfigError, match=r"primary_axes_by_grid.online is empty"):
        compose(["campaign=mixed_prefill", "+campaign.policy.primary_axes_by_grid.online=[]"], cuda=True)
    with pytest.raises(CampaignConfigError, match=r"traded_axes \['p99_itl'\] are primary axes"):
        compose(["campaign=mixed_prefill", "grid=long_prompt",
                 "campaign.policy.primary_axes_by_grid.long_prompt=[tpot,p99_itl]"], cuda=True)
    # the flat key on a grid that has its own entry would be replaced without a word: refused, naming the key to use
    with pytest.raises(CampaignConfigError, match=r"campaign.policy.primary_axes=\['tpot'\] would not decide this run: "
                                                  r".*primary_axes_by_grid.long_prompt=\['total_token_throughput', "
                                                  r"'tpot', 'max_itl'\].*override campaign.policy.primary_axes_by_"):
        compose(["campaign=mixed_prefill", "grid=long_prompt", "campaign.policy.primary_axes=[tpot]"], cuda=True)
    assert list(compose(["campaign=mixed_prefill", "campaign.policy.primary_axes=[tpot]"], cuda=True)
                .campaign.policy.primary_axes) == ["tpot"]                  # no entry for the online grid: it decides
    both = compose(["campaign=mixed_prefill", "grid=long_prompt", "campaign.policy.primary_axes=[tpot]",
                    "campaign.policy.primary_axes_by_grid.long_prompt=[tpot,max_itl]"], cuda=True)
    assert list(both.campaign.policy.primary_axes) == ["tpot", "max_itl"]


def test_arms_resolve_from_the_lever_file_default():
    from vtengine.levers import get
    cfg = compose(["campaign=nsplits_cap"], cuda=False)
    assert cfg.campaign.arms.baseline == get("nsplits_cap").default == "off"
    assert list(cfg.campaign.arms.candidates) == ["auto"]
    cfg = compose(["campaign=nsplits_cap", "campaign.arms.candidates=[auto,8]"], cuda=False)
    assert list(cfg.campaign.arms.candidates) == ["auto", 8]


def test_bool_campaigns_measure_the_flip_of_the_current_default():
    # candidates: null = the lever's other values, so a campaign still runs (the way back) after a FLIP lands
    from vtengine.levers import effective_defaults
    for name in ("gqa_swap", "marlin_dense", "pdl", "triton_gemv", "fast_math"):
        cfg = compose([f"campaign={name}"], cuda=False)
        default = effective_defaults(quant=cfg.model.quant)[name]       # its quantization's (pdl: on for bf16)
        assert (cfg.campaign.arms.baseline, list(cfg.campaign.arms.candidates)) == (default, [not default]), name
    cfg = compose(["campaign=gqa_swap", "campaign.arms.baseline=true"], cuda=False)
    assert list(cfg.campaign.arms.candidates) == [False]


def test_user_choices_override_the_host_defaults():
    cfg = compose(["campaign=gqa_swap", "grid.reps=5", "model=qwen3-8b", "model.quant=nvfp4"], cuda=False)
    assert (cfg.grid.name, cfg.grid.reps, cfg.model.name, cfg.model.quant) == ("rehearsal", 5, "qwen3-8b", "nvfp4")
    cfg = compose(["campaign=marlin_dense", "grid=online"], cuda=False)      # allowed on CPU, then non-binding
    assert (cfg.device, cfg.grid.name, cfg.model.name, cfg.model.quant) == ("cpu", "online", "tiny", "mxfp4")
    cfg = compose(["campaign=gqa_swap", "device=cpu", "tracking=off", "commit=true"], cuda=True)
    assert (cfg.device, cfg.grid.name, cfg.tracking.enabled, cfg.commit) == ("cpu", "rehearsal", False, True)
    cfg = compose(["campaign=gqa_swap", "tracking=remote", "tracking.uri=http://mlflow:5000"], cuda=False)
    assert cfg.tracking.uri == "http://mlflow:5000"


@pytest.mark.parametrize("overrides,expected", [
    (["campaign=nope"],
     "unknown campaign 'nope'; accepted: async_device_mirror, async_scheduling, chunk_above, chunk_graphs"),
    ([], "no campaign chosen; add campaign=<name>, accepted: async_device_mirror, async_scheduling"),
    (["campaign=gqa_swap", "grid.reps=abc"], "bad value for grid.reps ('grid.reps=abc')"),
    (["campaign=gqa_swap", "grid.repz=3"], "unknown key 'grid.repz' in override 'grid.repz=3'; accepted keys of "
                                           "grid: name, binding, concurrency, reps"),
    (["campaign=gqa_swap", "grid=huge"],
     "unknown grid 'huge'; accepted: long_prompt, online, online_span, online_wide, rehearsal"),
    (["campaign=gqa_swap", "model=llama-70b"], "unknown model 'llama-70b'; accepted: "),
    (["campaign=gqa_swap", "model.quant=int8"], "model.quant='int8' is not accepted; accepted: bf16, mxfp4, nvfp4"),
    (["campaign=marlin_dense", "model.quant=bf16"], "model.quant=bf16 for lever marlin_dense: none of the kernels "
                                                     "['w4a16_gemm'] runs on bf16 weights"),
    (["campaign=gqa_swap", "campaign.arms.candidates=[7]"], "candidate arm 7 is not valid; accepted: true/false"),
    (["campaign=gqa_swap", "grid.concurrency=[1,2,3]"], "must have one entry per grid.concurrency [1, 2, 3]"),
    (["campaign=gqa_swap", "grid.concurrency=[2,2]", "grid.prompts_per_leg=[2,2]"], "repeats a value"),
    (["campaign=gqa_swap", "tracking=remote"], "tracking=remote needs tracking.uri=<uri>"),
    (["campaign=gqa_swap", "grid.residency=sequential"],
     "grid.residency='sequential' is not accepted; accepted: auto, together, alternate"),
    (["campaign=gqa_swap", "device=tpu"], "device='tpu' is not accepted; accepted: auto, cuda, cpu"),
    (["campaign=gqa_swap", "allow_dirty=maybe"], "bad value for allow_dirty"),
    (["campaign=gqa_swap", "grid.reps"], "bad override syntax"),
    (["campaign=gqa_swap", "+foo=1"], "unknown top-level key(s) ['foo']; accepted: campaign, model, grid"),
    (["campaign=gqa_swap,pdl"], "campaign=gqa_swap,pdl lists several options: a sweep runs them, one campaign "
                                "each: vtcampaign run -m campaign=gqa_swap,pdl"),
    (["campaign=gqa_swap,nope"], "unknown campaign 'gqa_swap,nope'; accepted: "),
    (["campaign=mixed_prefill", "+campaign.with_levers={chunked_prefill: 2048}"],
     "campaign.with_levers pins 'chunked_prefill', which the campaign's lever 'mixed_prefill' sets (a preset: "
     "chunked_prefill=512 when on)"),
])
def test_bad_overrides_give_one_clear_line(overrides, expected, capsys):
    with pytest.raises(CampaignConfigError, match=None) as err:
        compose(overrides, cuda=False)
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert main(["run", *overrides, "--dry-run"]) == 2
    assert expected in _error_line(capsys)


def test_dry_run_prints_the_composed_config_and_plan(capsys):
    assert main(["run", "campaign=marlin_dense", "--dry-run", "grid.reps=4", "device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "lever: marlin_dense" in out and "quant: mxfp4" in out and "reps: 4" in out
    assert out.rstrip().splitlines()[-1].startswith("# plan: marlin_dense on cpu (non-binding), 2 arms")
    assert "16 legs (2 concurrencies x 4 reps x 2 arms)" in out


def test_hydra_flags_cfg_info_and_config_dir_work_on_a_single_run(tmp_path, capsys):
    """What a Hydra user types: --cfg job prints the composed config and runs nothing (a project's conf named by
    -cd laid over the packaged one), --info the search path and the options chosen; --cfg hydra is refused, saying
    why and where it works."""
    import yaml

    from vtengine import confdirs
    assert main(["run", "campaign=marlin_dense", "grid.reps=4", "device=cpu", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    assert cfg["campaign"]["lever"] == "marlin_dense" and cfg["grid"]["reps"] == 4 and "# plan" not in out
    assert main(["run", "campaign=marlin_dense", "--info"]) == 0
    out = capsys.readouterr().out
    assert "Config search path" in out and f"  {confdirs.PACKAGED.resolve()}  (packaged)" in out
    assert "  campaign  marlin_dense" in out and "  model     tiny (mxfp4)" in out
    assert main(["run", "campaign=gqa_swap", "--cfg", "hydra"]) == 2
    assert "a sweep (run -m ...) is a Hydra app that takes --cfg hydra" in _error_line(capsys)
    own = tmp_path / "conf" / "grid"
    own.mkdir(parents=True)
    (own / "mine.yaml").write_text((confdirs.PACKAGED / "grid" / "rehearsal.yaml").read_text()
                                   .replace("reps: 2", "reps: 7"))
    try:
        assert main(["run", "campaign=gqa_swap", "grid=mine", "-cd", str(tmp_path / "conf"), "-c", "job"]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["grid"]["reps"] == 7
    finally:
        confdirs.set_project_conf(None)
    assert main(["run", "campaign=gqa_swap", "grid=mine", "--cfg", "job"]) == 2      # gone with -cd
    assert "unknown grid 'mine'; accepted: " in _error_line(capsys)


def test_unknown_option_is_a_usage_error(capsys):
    assert main(["run", "campaign=gqa_swap", "--fast"]) == 2
    assert "unknown option(s) ['--fast']" in _error_line(capsys)


# ----------------------------------------------------------------------------------------------- views


def test_decide_applies_the_policy_again_and_keeps_the_earlier_verdict(tmp_path, monkeypatch, capsys):
    """A campaign decided NON-BINDING because an older runner counted a bench result as dirt: `decide` reads it
    again with this checkout's policy; the new verdict names the old one; a second `decide` changes nothing."""
    import git
    repo = git.Repo.init(tmp_path)
    (tmp_path / "f").write_text("x\n")
    repo.index.add(["f"])
    repo.index.commit("init")
    monkeypatch.chdir(tmp_path)
    ev = make_evidence(TPUT_WIN)
    ev.fingerprint.dirty, ev.fingerprint.dirty_files = True, ["bench/results/decode-1.json"]
    ev.decision.verdict, ev.decision.reasons = "NON-BINDING", ["the git tree was dirty (bench/results/decode-1.json)"]
    out = tmp_path / "records" / "campaigns"
    save_evidence(ev, out / ev.campaign_id)
    assert main(["decide", ev.campaign_id, "--out-dir", str(out)]) == 0
    assert "NON-BINDING -> FLIP" in capsys.readouterr().out
    d = load_evidence(out / ev.campaign_id / "evidence.json").decision
    assert d.verdict == "FLIP" and d.binding
    assert d.reasons[-1].startswith("decided again by `vtcampaign decide`") and "it had read NON-BINDING" in d.reasons[-1]
    assert "FLIP" in (out / ev.campaign_id / "record.md").read_text().splitlines()[0]
    assert main(["decide", ev.campaign_id, "--out-dir", str(out)]) == 0
    assert "FLIP, unchanged" in capsys.readouterr().out
    # a headline an older policy wrote differently is read again too (verdict and reasons the same)
    ev2 = load_evidence(out / ev.campaign_id / "evidence.json")
    fresh_headline, ev2.decision.headline = ev2.decision.headline, "TPOT x0.999 at c4 (NEUTRAL)"
    save_evidence(ev2, out / ev.campaign_id)
    assert main(["decide", ev.campaign_id, "--out-dir", str(out)]) == 0
    assert f"FLIP -> FLIP ({fresh_headline})" in capsys.readouterr().out
    reads = load_evidence(out / ev.campaign_id / "evidence.json").decision.reasons[-2:]
    assert "it had read NON-BINDING" in reads[0] and "it had read FLIP" in reads[1]      # both reads kept
    # where a verdict was concluded (a device command cut off before it) is history too: it survives a re-read
    ev3 = load_evidence(out / ev.campaign_id / "evidence.json")
    concluded = "concluded on 2026-12-05 at abc1234 from the recorded gates and legs (the run at abc1234 on X ...)"
    ev3.decision.reasons.append(concluded)
    ev3.decision.headline = "TPOT x0.999 at c4 (NEUTRAL)"
    save_evidence(ev3, out / ev.campaign_id)
    assert main(["decide", ev.campaign_id, "--out-dir", str(out)]) == 0
    assert concluded in load_evidence(out / ev.campaign_id / "evidence.json").decision.reasons
    capsys.readouterr()
    # a byte-exactness an older policy claimed (from the battery) is read again: the record printed the claim
    ev4 = load_evidence(out / ev.campaign_id / "evidence.json")
    fresh_exact, ev4.decision.byte_exact = ev4.decision.byte_exact, not ev4.decision.byte_exact
    save_evidence(ev4, out / ev.campaign_id)
    assert main(["decide", ev.campaign_id, "--out-dir", str(out)]) == 0
    assert "changed: byte_exact" in capsys.readouterr().out
    assert load_evidence(out / ev.campaign_id / "evidence.json").decision.byte_exact == fresh_exact
    ev.status, ev.campaign_id = "in-progress", "2026-01-02-gqa_swap-abc1234"
    save_evidence(ev, out / ev.campaign_id)
    assert main(["decide", ev.campaign_id, "--out-dir", str(out)]) == 2
    err = _error_line(capsys)
    assert "is in progress (" in err and "finish it first" in err and "resume=2026-01-02" in err
    # --all: every complete campaign (the in-progress one left alone), one line each and a count
    assert main(["decide", "--all", "--out-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "0 of 1 complete campaigns decided again" in said and "2026-01-02" not in said
    # a decide cut after saving the evidence, before rendering: the rerun finds nothing to decide but renders
    record = out / "2026-11-30-gqa_swap-abc1234" / "record.md"
    fresh_record = record.read_text()
    record.write_text("# OLD HEADLINE\n")
    assert main(["decide", "--all", "--out-dir", str(out)]) == 0
    assert "its record is behind its evidence; rendered again" in capsys.readouterr().out
    assert record.read_text() == fresh_record
    assert main(["decide", "--out-dir", str(out)]) == 2 and "not neither" in _error_line(capsys)
    assert main(["decide", "--all", ev.campaign_id, "--out-dir", str(out)]) == 2 and "not both" in _error_line(capsys)


@pytest.fixture
def out_dir(tmp_path):
    ev = make_evidence(TPUT_WIN)
    out = tmp_path / "records" / "campaigns"
    save_evidence(ev, out / ev.campaign_id)
    return out, ev


def test_pr_prints_the_rendered_pr_text(out_dir, capsys):
    out, ev = out_dir
    assert main(["pr", ev.campaign_id, "--out-dir", str(out)]) == 0
    assert capsys.readouterr().out == records.render_pr(ev)
    assert main(["pr", "2026-01-01-x-0000000", "--out-dir", str(out)]) == 2
    assert f"unknown campaign id '2026-01-01-x-0000000' under {out}; accepted: {ev.campaign_id}" in _error_line(capsys)


def test_render_and_status(out_dir, capsys):
    out, ev = out_dir
    assert main(["render", "--out-dir", str(out), "--no-plots"]) == 0
    assert "from 1 evidence file(s)" in capsys.readouterr().out
    assert (out / ev.campaign_id / "record.md").read_text() == records.render_record(ev)
    # a campaigns directory that is not the project's own gets its summaries beside its campaigns, where a run
    # into it writes them (runner.status_dir), never in the project's records/
    assert (out / "STATUS.md").is_file() and (out / "BENCHMARKS.md").is_file()
    assert not (out.parent / "STATUS.md").exists()
    assert main(["status", "--out-dir", str(out)]) == 0
    table = capsys.readouterr().out
    row = next(ln for ln in table.splitlines() if "gqa_swap" in ln)
    assert "VT_DECODE_GQA_SWAP" in row and ev.campaign_id in row and "FLIP" in row and "yes" in row
    assert main(["render", "--out-dir", str(out / "nowhere")]) == 2
    assert "nowhere' is not a directory; pass a campaigns folder" in _error_line(capsys)


def test_status_rows_show_their_own_quantizations_default_and_value(tmp_path, monkeypatch, capsys):
    """pdl_stack on for bf16 sets pdl_prefetch there: `vtcampaign status` showed the bf16 row of pdl_prefetch with
    default False and resolved False (the plain default, quantization unknown). Each row now shows its own
    quantization's default and the value an engine on it would run, and where that value comes from."""
    import dataclasses
    from vtengine import levers
    plain_defaults(monkeypatch)
    plain = levers.registry
    monkeypatch.setattr(levers, "registry", lambda lever_dir=None: {
        **plain(lever_dir), "pdl_stack": dataclasses.replace(plain(lever_dir)["pdl_stack"],
                                                             default_by_quant={"bf16": True})})
    monkeypatch.delenv("VT_PDL_PREFETCH", raising=False)
    monkeypatch.delenv("VT_PDL_STACK", raising=False)
    out = tmp_path / "records" / "campaigns"
    for quant in ("bf16", "mxfp4"):
        ev = make_evidence(TPUT_WIN, lever="pdl_prefetch", campaign_id=f"2026-12-04-pdl_prefetch-{quant}-abc1234")
        ev.config["model"]["quant"] = quant
        ev.__dict__.pop("_settings", None)
        save_evidence(ev, out / ev.campaign_id)
    assert main(["status", "--out-dir", str(out)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("│ pdl_prefetch ")]
    cells = [[c.strip() for c in ln.split("│")[1:7]] for ln in rows]
    assert cells == [["pdl_prefetch", "qwen3-8b (bf16)", "H200", "True", "VT_PDL_PREFETCH", "True (preset pdl_stack)"],
                     ["pdl_prefetch", "qwen3-8b (mxfp4)", "H200", "False", "VT_PDL_PREFETCH", "False (default)"]]


def test_status_lists_unfinished_campaigns_and_what_can_finish_each(tmp_path, capsys):
    """A campaign cut mid-grid stays unfinished until a resume on its code takes it; once the code changes, none
    will. `vtcampaign status` lists each unfinished one with how far it came and what finishes it: the resume
    command where this checkout's code and tree are the campaign's (here, or on a host with the device and
    versions it names), `vtcampaign conclude` where only the verdict is left, else why it cannot resume here. A
    complete campaign is not listed."""
    import dataclasses

    import torch

    from campaigns.fingerprint import host_setup
    from campaigns.gitops import RUN_OUTPUTS, code_digest, open_repo, repo_state
    from vtengine import confdirs
    out = tmp_path / "records" / "campaigns"
    here = open_repo(confdirs.SOURCE_ROOT).head.commit.hexsha
    tree = repo_state(confdirs.SOURCE_ROOT, ignore=RUN_OUTPUTS)                   # the checkout as it is now
    dirty = tree.dirty_files
    setup = host_setup("cuda" if torch.cuda.is_available() else "cpu")

    def put(cid, status="in-progress", legs=None, **fp):
        ev = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id=cid)
        ev.status = status
        ev.legs = ev.legs[:legs] if legs is not None else ev.legs
        ev.peak_memory_gib = {a.name: 1.0 for a in ev.arms}
        ev.context = {a.name: {"gqa_swap": a.value} for a in ev.arms}
        ev.fingerprint = dataclasses.replace(ev.fingerprint, **{"dirty_files": dirty, "dirty_digest": tree.dirty_digest, **fp})
        save_evidence(ev, out / cid)
    put("2026-12-01-gqa_swap-done", status="complete")
    put("2026-12-02-gqa_swap-verdict-left")
    put("2026-12-03-gqa_swap-here", legs=5, git_sha=here, git_short_sha=here[:7], torch_version="0.0-test")
    put("2026-12-04-gqa_swap-same-code", legs=6, code_digest=code_digest(confdirs.SOURCE_ROOT))
    put("2026-12-05-gqa_swap-old-code", legs=7, code_digest="0" * 64)
    put("2026-12-06-gqa_swap-no-digest", legs=8)
    put("2026-12-07-gqa_swap-this-host", legs=9, git_sha=here, git_short_sha=here[:7], **setup)
    put("2026-12-08-gqa_swap-other-tree", legs=10, git_sha=here, git_short_sha=here[:7],
        dirty_files=sorted({*dirty, "vtengine/kernels/not_here.py"}))
    put("2026-12-09-gqa_swap-running", legs=3)
    import subprocess
    import sys
    runner_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "campaigns.cli", "run"])
    try:
        (out / "2026-12-09-gqa_swap-running" / "runner.pid").write_text(f"{runner_proc.pid}\n")
        assert main(["status", "--out-dir", str(out)]) == 0
    finally:
        runner_proc.kill()
        runner_proc.wait()
    text = " ".join(capsys.readouterr().out.split())
    assert "8 unfinished campaign(s):" in text and "gqa_swap-done" not in text.split("unfinished campaign(s):")[1]
    assert (f"2026-12-09-gqa_swap-running (3 legs, 16 gate results, on H200 at abc1234): running now (pid "
            f"{runner_proc.pid}); nothing to do but wait, or stop it") in text
    assert ("2026-12-02-gqa_swap-verdict-left (24 legs, 16 gate results, on H200 at abc1234): only its verdict is "
            "left: `vtcampaign conclude 2026-12-02-gqa_swap-verdict-left`") in text
    # the resume checks the device and versions too: an H200 campaign is resumed on a host that has them
    assert (f"2026-12-03-gqa_swap-here (5 legs, 16 gate results, on H200 at {here[:7]}): resume on a host with "
            f"device NVIDIA H200 (here {setup['device_name']}); torch 0.0-test (here {setup['torch_version']})") in text
    assert "resume=2026-12-03-gqa_swap-here`" in text
    assert "resume=2026-12-04-gqa_swap-same-code`" in text          # another commit, the same code
    assert "2026-12-07-gqa_swap-this-host (9 legs, 16 gate results, on " in text
    assert ": resume here with `vtcampaign run campaign=gqa_swap <the overrides it ran with> " \
           "resume=2026-12-07-gqa_swap-this-host`" in text
    assert (f"2026-12-08-gqa_swap-other-tree (10 legs, 16 gate results, on H200 at {here[:7]}): not resumable on "
            "this checkout as it is (the campaign ran on a tree dirty in ") in text
    assert "vtengine/kernels/not_here.py, the checkout is " in text
    assert ("2026-12-05-gqa_swap-old-code (7 legs, 16 gate results, on H200 at abc1234): not resumable on this "
            "checkout (the code has changed since); resume on a checkout of abc1234") in text
    assert "gqa_swap-no-digest (8 legs, 16 gate results, on H200 at abc1234): not resumable on this checkout (its " \
           "code digest was not recorded)" in text


def test_summaries_of_a_run_elsewhere_stay_next_to_its_records(tmp_path):
    # a rehearsal into a scratch out_dir must not overwrite the repository's STATUS.md / BENCHMARKS.md (they list
    # every campaign of the out_dir they are rendered from)
    from campaigns.runner import status_dir
    repo = tmp_path / "repo"
    assert status_dir(repo, repo / "records" / "campaigns") == (repo / "records").resolve()
    assert status_dir(repo, tmp_path / "scratch") == (tmp_path / "scratch").resolve()


def test_commands_run_from_a_subfolder_use_the_projects_records(tmp_path, monkeypatch, capsys):
    """`vtcampaign status` (and every command's default --out-dir) reads records/campaigns at the top of the git
    work tree, as git finds it, not a records/ of the folder the command runs in."""
    from helpers import temp_repo
    repo = temp_repo(tmp_path)
    ev = make_evidence(TPUT_WIN)
    save_evidence(ev, repo / "records" / "campaigns" / ev.campaign_id)
    (repo / "vtengine").mkdir()
    monkeypatch.chdir(repo / "vtengine")
    assert main(["pr", ev.campaign_id]) == 0
    assert capsys.readouterr().out.startswith("row/gqa_swap")
    from campaigns.cli import project_root
    assert project_root() == repo and project_root(tmp_path) == tmp_path       # outside a repository: itself


def test_dry_run_with_resume_says_what_is_left_and_checks_the_id(tmp_path, monkeypatch, capsys):
    """--dry-run with resume= names the campaign it would take, the legs done and left, and refuses what a real
    resume refuses (an unknown id)."""
    import dataclasses

    import git

    from campaigns.config import config_hash
    from campaigns.fingerprint import collect
    from helpers import temp_repo
    from vtengine import levers
    repo = temp_repo(tmp_path)
    monkeypatch.chdir(repo)
    cfg = compose(["campaign=gqa_swap", "tracking=off", "resume=auto"], cuda=False)
    ev = make_evidence(reps=2, concurrency=(1, 2), campaign_id="2026-12-03-gqa_swap-abc1234")
    ev.status, ev.legs = "in-progress", ev.legs[:3]
    ev.fingerprint = dataclasses.replace(collect(repo, "cpu", levers.get("gqa_swap").env, ev.arms, config_hash(cfg)),
                                         git_sha=git.Repo(repo).head.commit.hexsha)
    save_evidence(ev, repo / "records" / "campaigns" / ev.campaign_id)
    assert main(["run", "campaign=gqa_swap", "tracking=off", "resume=auto", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# resume 2026-12-03-gqa_swap-abc1234 (in-progress): 16 gate results kept, 3 of 8 legs done, 5 left" in out
    assert main(["run", "campaign=gqa_swap", "tracking=off", "resume=nope", "--dry-run"]) == 2
    assert "resume='nope': no evidence at" in _error_line(capsys)


def test_vtengine_levers_lists_each_levers_last_verdict(tmp_path, monkeypatch, capsys):
    """DESIGN: `vtengine levers` lists every lever with its resolved value and last verdict (per model)."""
    from helpers import temp_repo
    from vtengine import cli as engine_cli
    repo = temp_repo(tmp_path)
    ev = make_evidence(TPUT_WIN)
    save_evidence(ev, repo / "records" / "campaigns" / ev.campaign_id)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("COLUMNS", "400")
    assert engine_cli.main(["levers"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("│ gqa_swap "))
    assert "FLIP on qwen3-8b (bf16), 2026-11-30" in row


def test_the_usage_line_names_every_command(capsys):
    """`vtcampaign --help` once listed its commands from a hand-written string, which missed `conclude` when that
    command was added: the usage and the help name every command the parser accepts."""
    from campaigns.cli import _parser
    p = _parser()
    commands = next(a for a in p._actions if a.dest == "cmd").choices
    assert "conclude" in commands and "recheck" in commands
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "{" + ",".join(commands) + "}" in usage.replace(" ", "").replace("\n", "")


def test_run_exits_non_zero_when_the_product_or_the_candidate_fails():
    """CI reads `vtcampaign run`'s status: any decision reached is 0 (a REJECT-PERFORMANCE is a finding, not an
    error), a failed self-check or a void grid (INVALID) and a grid that invents effects (AA-FAIL) are 3, a
    candidate that breaks correctness is 4."""
    from campaigns.cli import exit_code
    from campaigns.evidence import VERDICTS
    codes = {v: exit_code(v) for v in VERDICTS}
    assert codes == {"INVALID": 3, "REJECT-CORRECTNESS": 4, "NON-BINDING": 0, "FLIP": 0, "REJECT-PERFORMANCE": 0,
                     "KEEP": 0, "AA-PASS": 0, "AA-FAIL": 3}
    assert exit_code(None) == 0


def test_a_server_that_did_not_start_in_a_many_armed_gpu_campaign_is_told_about_its_memory_share():
    import dataclasses

    from campaigns.evidence import Arm
    from campaigns.runner import memory_hint
    from helpers import make_evidence
    ev = make_evidence(lever="nsplits_cap")
    ev.fingerprint = dataclasses.replace(ev.fingerprint, device_type="cuda")
    assert "the 2 arms' servers run side by side, each with 45% of the GPU's memory" in memory_hint(
        ev, "the 'on' server did not start (exited with 1)")
    ev.arms = ev.arms + [Arm("8", 8, "candidate"), Arm("16", 16, "candidate"), Arm("auto", "auto", "candidate")]
    hint = memory_hint(ev, "the '8' server did not start (exited with 1); log x")
    assert "the 5 arms' servers run side by side, each with 18% of the GPU's memory" in hint
    assert "grid.residency=alternate runs them one at a time" in hint
    assert memory_hint(ev, "cannot read http://x/metrics") == ""
    ev.residency = "alternate"              # one at a time already: the share is not what failed
    assert memory_hint(ev, "the '8' server did not start (exited with 1); log x") == ""
    # what makes grid.residency=auto run the arms one at a time: a start that failed for memory, nothing else
    from campaigns.grid import out_of_memory
    assert out_of_memory("the 'on' server did not start (exited with 1); log x:\nConfigError: no room for the KV "
                         "cache (-3 blocks)")
    assert out_of_memory("the 'on' server did not start (exited with 1); log x:\ntorch.OutOfMemoryError: CUDA out of "
                         "memory. Tried to allocate 2.00 GiB")
    assert not out_of_memory("the 'on' server did not start (exited with 1); log x:\nValueError: bad --lever")
    assert not out_of_memory("leg c=8 rep=0: CUDA out of memory")        # not a start: a leg's failure


def test_abandon_gives_up_unfinished_campaigns_keeping_their_evidence(tmp_path, capsys):
    """A campaign cut before a code change can never resume on today's code; `vtcampaign status` listed such ones
    for good. `vtcampaign abandon` marks them: status no longer lists them, resume=<id> and conclude refuse them,
    every gate and leg stays in the evidence, and the record says when and why. --unresumable takes exactly the
    ones status calls not resumable on this checkout; a bad id among good ones changes nothing."""
    import dataclasses

    from campaigns.completion import _unfinished
    from campaigns.gitops import open_repo
    import subprocess

    from campaigns import fingerprint as fp
    from campaigns.config import config_hash
    from campaigns.runner import CampaignError, _resumable, conclude_recorded, not_dirt
    from campaigns.runner import _unfinished as newest_unfinished
    from campaigns.tracking import _parent_tags
    from vtengine import confdirs
    out = tmp_path / "records" / "campaigns"
    here = open_repo(confdirs.SOURCE_ROOT).head.commit.hexsha

    def put(cid, status="in-progress", legs=5, **fp):
        ev = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id=cid)
        ev.status, ev.legs = status, ev.legs[:legs]
        ev.decision = ev.decision if status == "complete" else None
        ev.peak_memory_gib = {a.name: 1.0 for a in ev.arms}
        ev.context = {a.name: {"gqa_swap": a.value} for a in ev.arms}
        ev.fingerprint = dataclasses.replace(ev.fingerprint, **fp)
        save_evidence(ev, out / cid)
    put("2026-12-01-gqa_swap-old", code_digest="0" * 64)
    put("2026-12-02-gqa_swap-older", legs=3)                          # no code digest: not resumable either
    put("2026-12-03-gqa_swap-here", git_sha=here, git_short_sha=here[:7])
    put("2026-12-04-gqa_swap-done", status="complete", legs=24)
    put("2026-12-05-gqa_swap-all-legs", legs=24)                      # only its verdict is left: conclude it

    assert main(["abandon", "2026-12-01-gqa_swap-old", "nope", "--why", "x", "--out-dir", str(out)]) == 2
    err = _error_line(capsys)
    assert "unknown campaign id 'nope'" in err and "2026-12-01-gqa_swap-old" in err      # names the unfinished
    assert load_evidence(out / "2026-12-01-gqa_swap-old").status == "in-progress"         # nothing changed
    for cid, says in (("2026-12-04-gqa_swap-done", "is complete already"),
                      ("2026-12-05-gqa_swap-all-legs", "`vtcampaign conclude 2026-12-05-gqa_swap-all-legs`")):
        assert main(["abandon", cid, "--why", "x", "--out-dir", str(out)]) == 2
        assert says in _error_line(capsys)
    assert main(["abandon", "--why", " ", "--unresumable", "--out-dir", str(out)]) == 2
    assert "--why is empty" in _error_line(capsys)

    why = "cut at 60459cb before the split rule changed; measured anew in 2026-12-07-prefill_splits-144ed18"
    assert main(["abandon", "--unresumable", "--why", why, "--out-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "2026-12-01-gqa_swap-old: abandoned (5 legs and 16 gate results kept)" in said
    assert "2026-12-02-gqa_swap-older: abandoned (3 legs" in said and "gqa_swap-here" not in said
    ev = load_evidence(out / "2026-12-01-gqa_swap-old")
    assert ev.status == "abandoned" and ev.abandoned["why"] == why and len(ev.legs) == 5 and len(ev.gates) == 16
    # the summaries of a folder other than the project's records/campaigns go into it, as every render puts them
    # (abandon wrote them one level up: with --out-dir records/rehearsal, over the project's own STATUS.md)
    assert (out / "STATUS.md").is_file() and not (out.parent / "STATUS.md").exists()
    assert main(["decide", "2026-12-01-gqa_swap-old", "--out-dir", str(out)]) == 2
    assert "was abandoned (cut at 60459cb" in (err := _error_line(capsys)) and "run the campaign anew" in err
    assert main(["decide", "2026-12-05-gqa_swap-all-legs", "--out-dir", str(out)]) == 2
    assert "`vtcampaign conclude 2026-12-05-gqa_swap-all-legs`" in _error_line(capsys)
    assert main(["status", "--out-dir", str(out / "typo")]) == 2
    assert f"--out-dir '{out / 'typo'}' is not a directory" in _error_line(capsys)
    record = " ".join((out / "2026-12-01-gqa_swap-old" / "record.md").read_text().split())
    assert f"No decision: the campaign was abandoned on {ev.abandoned['at'][:10]} ({why}), with 5 legs" in record
    assert "**Default.** `gqa_swap` stays false: the campaign decided nothing." in record
    pr = " ".join((out / "2026-12-01-gqa_swap-old" / "pr.md").read_text().split())
    assert f"Abandoned on {ev.abandoned['at'][:10]}, without a verdict: {why}." in pr and "In progress" not in pr
    assert _unfinished(out) == ["2026-12-03-gqa_swap-here", "2026-12-05-gqa_swap-all-legs"]   # resume= completion
    assert main(["status", "--out-dir", str(out)]) == 0
    listed = " ".join(capsys.readouterr().out.split()).split("unfinished campaign(s):")[1]
    assert "gqa_swap-here" in listed and "gqa_swap-old" not in listed and "gqa_swap-older" not in listed
    with pytest.raises(CampaignError, match=r"2026-12-01-gqa_swap-old was abandoned on .* \(cut at 60459cb"):
        conclude_recorded("2026-12-01-gqa_swap-old", confdirs.SOURCE_ROOT, out)
    cfg = compose(["campaign=gqa_swap", "resume=2026-12-01-gqa_swap-old"])
    with pytest.raises(CampaignError, match="abandoned on .*run the campaign anew"):
        _resumable(cfg, out / "2026-12-01-gqa_swap-old", confdirs.SOURCE_ROOT, out)
    assert main(["abandon", "2026-12-01-gqa_swap-old", "--why", "again", "--out-dir", str(out)]) == 2
    assert "is abandoned already" in _error_line(capsys)
    tags = _parent_tags(ev)
    assert tags["verdict"] == "ABANDONED" and tags["status"] == "abandoned" and tags["abandoned"] == why

    # resume=auto takes the newest unfinished campaign of this config and code, never an abandoned one; one that
    # is running now (its runner.pid a live campaign process) is not abandoned under it
    cfg = compose(["campaign=gqa_swap"])
    cid = "2026-12-09-gqa_swap-auto"
    put(cid)
    ev = load_evidence(out / cid)
    ev.fingerprint = fp.collect(confdirs.SOURCE_ROOT, cfg.device, "VT_DECODE_GQA_SWAP", ev.arms, config_hash(cfg),
                                ignore_dirty=not_dirt(confdirs.SOURCE_ROOT, out))
    save_evidence(ev, out / cid)
    assert newest_unfinished(cfg, confdirs.SOURCE_ROOT, out) == cid
    running = subprocess.Popen(["bash", "-c", "exec -a vtcampaign-test sleep 60"])
    try:
        (out / cid / "runner.pid").write_text(f"{running.pid}\n")
        assert main(["abandon", cid, "--why", "x", "--out-dir", str(out)]) == 2
        assert f"{cid} is running now (pid {running.pid}" in _error_line(capsys)
    finally:
        running.kill()
        running.wait()
    assert main(["abandon", cid, "--why", "superseded", "--out-dir", str(out)]) == 0     # a dead pid's file: stale
    assert newest_unfinished(cfg, confdirs.SOURCE_ROOT, out) is None


def test_a_server_that_does_not_start_is_a_failed_run_exit_5_not_a_usage_error(tmp_path, monkeypatch, capsys):
    """Exit 2 says the user's input was wrong; a server that did not start (here one that exits at once, through
    the real start path) is the run's own failure: exit 5, the evidence kept in progress for a resume."""
    import sys

    from campaigns import grid
    from helpers import temp_repo
    repo = temp_repo(tmp_path)
    monkeypatch.chdir(repo)
    real_launch = grid._launch

    def dying(arm, cmd, log_path, env):
        return real_launch(arm, [sys.executable, "-c", "print('no such model'); raise SystemExit(1)"], log_path, env)
    monkeypatch.setattr(grid, "_launch", dying)
    assert main(["run", "campaign=gqa_swap", "tracking=off", "campaign.gates=[]"]) == 5
    err = capsys.readouterr().err
    assert "vtcampaign: run failed: the " in err and "server did not start (exited with 1)" in err
    assert "no such model" in err
    (evidence,) = (repo / "records" / "campaigns").glob("*/evidence.json")
    assert load_evidence(evidence).status == "in-progress"
