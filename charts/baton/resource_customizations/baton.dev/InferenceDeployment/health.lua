-- Argo CD health of a baton.dev InferenceDeployment, read from the status Baton's operator writes
-- (conditions Ready, Progressing and Degraded; each records the generation it judged).
--   Degraded     the operator reports a failure for the current spec
--   Progressing  the operator has not applied the current spec yet, or pods are not all Ready
--   Suspended    every engine pool is scaled to zero
--   Healthy      Ready at the current generation
-- Install as argocd-cm key resource.customizations.health.baton.dev_InferenceDeployment.
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local status = obj.status
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local generation = obj.metadata.generation or 0
local applied = status.observedGeneration or 0
local degraded = condition(status, "Degraded")
local ready = condition(status, "Ready")

-- A failed reconcile does not advance observedGeneration; its condition names the generation.
if degraded ~= nil and degraded.status == "True"
    and ((degraded.observedGeneration or 0) >= generation or applied >= generation) then
  hs.status = "Degraded"
  hs.message = degraded.message or degraded.reason or "Degraded"
  return hs
end

if applied < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to apply generation " .. string.format("%d", generation)
  return hs
end

local pools, zero = 0, 0
for _, key in ipairs({"prefill", "decode", "pool"}) do
  local pool = status[key]
  if pool ~= nil then
    pools = pools + 1
    if (pool.desiredReplicas or 0) == 0 then
      zero = zero + 1
    end
  end
end
if pools > 0 and zero == pools then
  hs.status = "Suspended"
  hs.message = "Every engine pool is scaled to zero"
  return hs
end

if ready ~= nil and ready.status == "True" and (ready.observedGeneration or 0) >= generation then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end

hs.status = "Progressing"
if ready ~= nil and ready.message ~= nil then
  hs.message = ready.message
else
  hs.message = "Waiting for the engine pods to be Ready"
end
return hs
