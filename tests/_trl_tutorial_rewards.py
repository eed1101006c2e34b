"""The two reward functions of the TRL GRPO tutorial, as written there, for tests/test_python_rewards.py.

Source: Hugging Face cookbook, "Post training an LLM for reasoning with GRPO in TRL" by Sergio Paniego
(github.com/huggingface/cookbook, notebooks/en/fine_tuning_llm_grpo_trl.ipynb, section 3.3 "Loading
Reward Functions"; Apache-2.0), the tutorial TRL's GRPO documentation points to. Both functions are
copied unchanged (the unused `rewards_list` included): the point of the test is that they run as
written. They expect conversational completions (`completion[0]["content"]`) and a `solution` column.
"""

import re
def format_reward(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    rewards_list = [1.0 if match else 0.0 for match in matches]
    return [1.0 if match else 0.0 for match in matches]


from math_verify import LatexExtractionConfig, parse, verify
def accuracy_reward(completions, **kwargs):
    """Reward function that checks if the completion is the same as the ground truth."""
    solutions = kwargs['solution']
    completion_contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, solution in zip(completion_contents, solutions):
        gold_parsed = parse(solution, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()])
        answer_parsed = parse(content, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()])
        if len(gold_parsed) != 0:
            try:
                rewards.append(float(verify(answer_parsed, gold_parsed)))
            except Exception:
                rewards.append(0.0)
        else:
            rewards.append(1.0)
    return rewards
