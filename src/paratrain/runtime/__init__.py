"""This process: who started it and its place in the group (`env.detect`, read once at an entry and handed
down), its hygiene (threads, malloc, its name, how it leaves: `proc`), the forkserver workers are forked from
(`prefork`), signals (`interrupt`), the out-of-memory killer (`oom`), clocks (`clock`), the machine's devices
(`devices`), and the process group once joined (`dist`)."""
