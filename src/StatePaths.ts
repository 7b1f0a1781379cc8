/**
 * Where a daemon keeps its state and its socket (docs/protocol.md section 1). Pure path logic shared
 * by the daemon's configuration and the client, which must not load the daemon's modules.
 */
import * as os from "node:os"
import * as path from "node:path"

/** `$AGENTD_HOME`, else `$XDG_STATE_HOME/agentd`, else `~/.local/state/agentd`. */
export const defaultStateDir = (env: NodeJS.ProcessEnv = process.env): string =>
  env["AGENTD_HOME"] ||
  (env["XDG_STATE_HOME"] ? path.join(env["XDG_STATE_HOME"], "agentd") : path.join(os.homedir(), ".local", "state", "agentd"))

/** Socket path precedence: explicit, then `AGENTD_SOCKET`, then `<stateDir>/agentd.sock`. */
export const resolveSocketPath = (stateDir: string, explicit?: string, env: NodeJS.ProcessEnv = process.env): string =>
  explicit || env["AGENTD_SOCKET"] || path.join(stateDir, "agentd.sock")

/** The socket a client reaches by default: `AGENTD_SOCKET`, else `<default state dir>/agentd.sock`. */
export const defaultSocketPath = (env: NodeJS.ProcessEnv = process.env): string =>
  resolveSocketPath(path.resolve(defaultStateDir(env)), undefined, env)
