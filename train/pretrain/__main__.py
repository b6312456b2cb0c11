"""``python -m distaff.train.pretrain --config RUN.yaml [key=value ...]``: one rank of pretraining."""

from distaff.train.core.distributed import exit_process
from distaff.train.pretrain.trainer import main

exit_process(main())
