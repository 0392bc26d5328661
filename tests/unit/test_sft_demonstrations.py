"""`sao sft`'s demonstration source for the style-shift task, as the CPU example configures it: the
demonstrations start exactly like the RL prompts, fit the model, and cover every scheduled style."""


from megatron_sao.config import load_config
from megatron_sao.envs.style_judges import STYLES, RuleBasedStyleJudge
from megatron_sao.envs.style_shift import SHORT_SYSTEM_PROMPT
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer
from megatron_sao.trainer import components as C
from megatron_sao.trainer.sft import load_demonstrations
from tests.paths import REPO

EXAMPLE = REPO / "examples" / "style_shift_cpu.yaml"


def styles_of(demos):
    judge = RuleBasedStyleJudge()
    return [next((s for s in STYLES if judge.adheres(d[-1]["content"], s)), None) for d in demos]


def test_style_shift_demonstrations_match_the_rl_prompts_and_fit():
    cfg = load_config(EXAMPLE, ["sft.demonstrations=300"])
    assert cfg.env.task_kwargs["system_prompt"] == SHORT_SYSTEM_PROMPT  # the example uses the short one
    demos = load_demonstrations(cfg)
    assert len(demos) == 300
    tasks = C.train_tasks(cfg)  # same generator and seed: the same prompts in the same order
    assert [d[:-1] for d in demos] == [tasks[i].messages for i in range(len(demos))]
    fmt = ChatFormatter(build_char_tokenizer())
    for d in demos:
        ids, mask = fmt.encode_demonstration(d)
        assert len(ids) <= cfg.model.max_seq_len
        assert sum(mask) <= cfg.rollout.max_new_tokens_per_turn  # the answer and its stop token
    assert set(styles_of(demos)) == set(STYLES)


def test_style_shift_demonstrations_follow_the_env_styles():
    cfg = load_config(EXAMPLE, ["sft.demonstrations=100"])
    cfg.env.kwargs["styles"] = ["cute", "classical"]
    assert set(styles_of(load_demonstrations(cfg))) == {"cute", "classical"}
