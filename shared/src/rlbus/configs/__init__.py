"""Typed config tree of every rlbus command. Importable without torch or vllm."""

from rlbus.configs.base import BaseConfig
from rlbus.configs.bus import BusConfig
from rlbus.configs.common import (
    CkptConfig,
    DeploymentConfig,
    FileMonitorConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    MonitorsConfig,
    OtelConfig,
    ResumeConfig,
    RunConfig,
    RunnableConfig,
    ServiceConfig,
    TrainingRunConfig,
    WandbMonitorConfig,
    WeightBroadcastConfig,
)
from rlbus.configs.inference import InferenceConfig, ServerConfig, VLLMConfig
from rlbus.configs.orchestrator import EnvConfig, EvalConfig, OrchestratorConfig, SamplingConfig
from rlbus.configs.rl import RLConfig
from rlbus.configs.sft import SFTConfig, SFTDataConfig
from rlbus.configs.slurm import SlurmConfig
from rlbus.configs.trainer import (
    AdamWConfig,
    FullOffloadConfig,
    MuonConfig,
    SGDConfig,
    SignSGDConfig,
    TrainerConfig,
    TrainerModelConfig,
)

__all__ = [
    "AdamWConfig",
    "BaseConfig",
    "BusConfig",
    "CkptConfig",
    "DeploymentConfig",
    "EnvConfig",
    "EvalConfig",
    "FileMonitorConfig",
    "FullOffloadConfig",
    "InferenceConfig",
    "LaunchConfig",
    "LogConfig",
    "ModelConfig",
    "MonitorsConfig",
    "MuonConfig",
    "OrchestratorConfig",
    "OtelConfig",
    "RLConfig",
    "ResumeConfig",
    "RunConfig",
    "RunnableConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SGDConfig",
    "SamplingConfig",
    "ServerConfig",
    "ServiceConfig",
    "SignSGDConfig",
    "SlurmConfig",
    "TrainerConfig",
    "TrainerModelConfig",
    "TrainingRunConfig",
    "VLLMConfig",
    "WandbMonitorConfig",
    "WeightBroadcastConfig",
]
