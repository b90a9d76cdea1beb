//! Which processes are services, and what they listen on: procfs parsers over a
//! configurable root (`procfs`), the listen queues of poolscope's own network
//! namespace (`sockdiag`) and of listeners other processes hold (`held`), the target
//! rules (`rules`), the watched set and its listening ports (`targets`), the CPUs a
//! service may use (`cpus`), the lock probes of the services that ask for them
//! (`lock_probes`), the pool each thread is in (`pools`), the kubelet's
//! names of pod containers (`pod_logs`), and the dense ids the kernel's arrays are indexed by (`ids`).
pub mod cpus;
pub mod held;
pub mod ids;
pub mod live;
pub mod lock_probes;
pub mod pod_logs;
pub mod pools;
pub mod procfs;
pub mod rules;
pub mod sockdiag;
pub mod targets;
