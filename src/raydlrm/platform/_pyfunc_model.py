"""The model code of a raydlrm pyfunc model (MLflow "models from code").

MLflow stores this file with the model and runs it when the model is loaded (after putting the
raydlrm source it carries on ``sys.path``): the scorer is built from code, never unpickled.
"""

import mlflow

from raydlrm.platform.export import RecModelPythonModel

mlflow.models.set_model(RecModelPythonModel())
