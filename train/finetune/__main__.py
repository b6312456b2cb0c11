"""``python -m distaff.train.finetune --config FT.yaml [key=value ...]``: one rank of fine-tuning."""

from distaff.train.core.distributed import exit_process
from distaff.train.finetune.trainer import main

exit_process(main())
