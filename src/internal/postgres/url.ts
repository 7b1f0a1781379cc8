/**
 * Whether a store setting names PostgreSQL: import-free, so that the daemon checks `--store`
 * without loading the PostgreSQL client (pg and its dependencies cost ~0.1-0.2 s of CPU at every
 * start: the daemon loads them only for a PostgreSQL store).
 */

/** True when `store` names a PostgreSQL store rather than the state dir's files. */
export const isPostgresUrl = (store: string): boolean => /^postgres(ql)?:\/\//.test(store)
