"""Training configuration: the single source of defaults, YAML load/save, validation.

Every field is also a `paratrain train` flag (cli/parser.py builds the flags from the field metadata), so a
value can come from the dataclass default, a YAML file, or the command line, in that order of priority.
"""

from __future__ import annotations

from ..core.errors import UserError
from .checks import READ_BY, changed, check_read, in_python_words, unread, validate
from .fields import (
                     ACTIVATIONS,
                     BATCHNORM,
                     DATASET_DEFAULTS,
                     DATASETS,
                     FIELDS,
                     FILES,
                     LOSSES,
                     LR_SCHEDULES,
                     METRICS,
                     MODELS,
                     OPTIMIZERS,
                     PIPELINE_SCHEDULES,
                     PRECISIONS,
                     REQUEUE_SIGNALS,
                     SECTIONS,
                     STRATEGIES,
                     TrainConfig,
                     did_you_mean,
                     shown,
)
from .sources import (
                     MAX_YAML_BYTES,
                     check_resume_out,
                     default_run_dir,
                     from_dict,
                     job_tag,
                     load_yaml,
                     of_run,
                     overlay,
                     save_yaml,
                     with_run_dir,
)

__all__ = ["ACTIVATIONS", "BATCHNORM", "DATASETS", "DATASET_DEFAULTS", "FIELDS", "FILES", "LOSSES", "LR_SCHEDULES",
           "MAX_YAML_BYTES", "METRICS", "MODELS", "OPTIMIZERS", "PIPELINE_SCHEDULES", "PRECISIONS", "READ_BY",
           "REQUEUE_SIGNALS", "SECTIONS", "STRATEGIES",
           "TrainConfig",
           "UserError", "changed", "check_read", "check_resume_out", "did_you_mean", "from_dict", "in_python_words",
           "load_yaml", "default_run_dir", "job_tag", "of_run", "overlay", "save_yaml", "shown", "unread", "validate",
           "with_run_dir"]
