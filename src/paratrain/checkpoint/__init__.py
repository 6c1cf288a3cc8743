"""A run's checkpoints and the folder that holds them.

    run_folder  the run folder: its lock for the run's life, the fresh-start checks, --overwrite's clearing,
                its checkpoints listed by step
    files       reading a checkpoint of either form, the newest that loads, agree; a whole-model file's atomic
                save (an export's, a search trial's kept weights; earlier releases' checkpoints)
    dcp         a step folder (torch.distributed.checkpoint), every layout's checkpoint: each rank its part
    manager     the one owner of a run's checkpoints: lists the folder once, knows the newest step and its form
    resume      which checkpoint a run carries on from, checked against the run that asks
"""
