"""Training agents written against the ``openai`` client: their calls are served by the policy,
recorded and assembled into trajectories (docs/agents.md).

``server``      ``AgentServer``: ``rljax serve`` in-process on 127.0.0.1, each episode's calls recorded
``trajectory``  ``assemble``: one episode's calls as joined sequences or separate transitions
``runner``      running the agent for episodes, scoring them, their rows and ``agent/*`` metrics
``sampler``     ``AgentSampler``: what an online run (``environment: {type: agent}``) samples with
"""

from rljax.agents.runner import AgentEpisode, agent_metrics, agent_rollout, load_agent, run_agent_episodes, score_episodes
from rljax.agents.sampler import AgentSampler
from rljax.agents.server import AgentServer
from rljax.agents.trajectory import assemble

__all__ = ["AgentEpisode", "AgentSampler", "AgentServer", "agent_metrics", "agent_rollout", "assemble", "load_agent",
           "run_agent_episodes", "score_episodes"]
