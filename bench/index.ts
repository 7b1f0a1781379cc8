/**
 * `npm run bench`: runs every benchmark in this folder (or those named on the command line,
 * e.g. `npm run bench -- framing eventLog`). Each benchmark prints the project's figure next
 * to a baseline measured in the same run and their ratio. `npm run bench -- stores` runs the
 * storage comparison (files vs PostgreSQL: appends, delivery, recovery) in one run.
 */
const benches: Record<string, () => Promise<{ default: () => Promise<void> }>> = {
  framing: () => import("./framing.js"),
  snapshotCache: () => import("./snapshotCache.js"),
  eventLog: () => import("./eventLog.js"),
  storeAppend: () => import("./storeAppend.js"),
  storeDelivery: () => import("./storeDelivery.js"),
  recovery: () => import("./recovery.js"),
  storeRecovery: () => import("./storeRecovery.js"),
  delivery: () => import("./delivery.js"),
  hotPath: () => import("./hotPath.js"),
  streaming: () => import("./streaming.js"),
  workerMemory: () => import("./workerMemory.js"),
  httpDelivery: () => import("./httpDelivery.js"),
  httpCatchUp: () => import("./httpCatchUp.js"),
  attach: () => import("./attach.js"),
  checkpoint: () => import("./checkpoint.js"),
  cliStartup: () => import("./cliStartup.js"),
  webOpen: () => import("./webOpen.js"),
  clusterDelivery: () => import("./clusterDelivery.js")
}

const STORES = ["storeAppend", "storeDelivery", "storeRecovery"]
const wanted = process.argv.slice(2).flatMap((name) => (name === "stores" ? STORES : [name]))
for (const [name, load] of Object.entries(benches)) {
  if (wanted.length > 0 && !wanted.includes(name)) continue
  console.log(`\n## ${name}`)
  const mod = await load()
  await mod.default()
}
