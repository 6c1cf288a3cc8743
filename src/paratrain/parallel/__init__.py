"""How a run is spread over processes and devices.

    strategies/  each parallelism (ddp, tower, pipeline, hybrid, fsdp, hsdp): its checks, its layout, and in
                 a worker how it builds, steps, evaluates and saves the model
    runplan      the frozen plan: processes, devices, batch split, data, the strategy's layout, the run's length
    launch       the workers started: in this process, forked or spawned here, or as torchrun's/srun's rank
    requeue      Slurm's warning before a job's end: save, then requeue the job
"""
