//! Maps and sets keyed by the kernel's small integers (tids, dense service and pool
//! ids) that a scrape looks up thousands of times: hashed by foldhash instead of
//! std's SipHash, whose per-key cost was ~3.5 % of a scrape at 110 services. The keys
//! come from the kernel and poolscope's own id allocator, not from a client, so
//! SipHash's resistance to chosen keys buys nothing here; foldhash is still seeded
//! per map.
pub type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub type IdSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
